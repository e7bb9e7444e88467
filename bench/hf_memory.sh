#!/usr/bin/env bash
# Per-rank memory while loading a Hugging Face Llama into shards and exporting it, at
# worlds 1 to RANKS under full shard: a random Llama made with transformers whose fp32
# size (about 131 MiB: 8 layers, width 512, vocabulary 16384) exceeds the per-rank share
# FlatShard keeps at 2 ranks and more. Prints, per world, each rank's allocations beyond
# its shards while loading and exporting (the counting allocator's peak), the planner's
# figures, and the whole model's size.
#
#   bench/hf_memory.sh [RANKS] [BUILD_DIR]      (EXTRA="--embedding-units": the embedding and
#                                               the head as units of their own)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
ranks="${1:-4}"
build="${2:-$root/build}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$FLATSHARD_VENV/bin/python" - "$out" <<'PY'
import sys, numpy as np, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
LlamaForCausalLM(cfg).save_pretrained(f"{sys.argv[1]}/model")
np.arange(4096, dtype=np.uint16).tofile(f"{sys.argv[1]}/tokens.bin")
PY
for n in $(seq 1 "$ranks"); do
  echo "== world $n, full shard"
  "$build/flatshard-run" -n "$n" --deadline-s 600 "$build/examples/finetune_llama" --model "$out/model" \
      --data "$out/tokens.bin" --seq-len 32 --batch 1 --steps 0 --out "$out/export$n" ${EXTRA:-} 2>&1 |
    sed -n 's/^\[rank 0\] //p' | grep -E "^(loaded|load:|export:)"
done
