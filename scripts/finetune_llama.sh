#!/usr/bin/env bash
# The fine-tuning recipe end to end (docs/fine-tuning.md): a small random Llama made with
# transformers, a token file from text on this machine, fine-tuned under full shard at 2
# and 4 ranks from its Hugging Face directory, stopped and resumed at 2 ranks (the resumed
# export must equal the uninterrupted one byte for byte), exported, and the exports checked
# with transformers (their logits must be FlatShard's).
#
#   scripts/finetune_llama.sh            # OUT=out/finetune STEPS=40 BUILD=build
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
OUT="${OUT:-$root/out/finetune}"
STEPS="${STEPS:-40}"
BUILD="${BUILD:-$root/build}"
py="$FLATSHARD_VENV/bin/python"
run="$BUILD/flatshard-run"
tune="$BUILD/examples/finetune_llama"
[[ -x "$tune" ]] || { echo "build first: scripts/build.sh ($tune is missing)" >&2; exit 2; }
rm -rf "$OUT"
mkdir -p "$OUT"
"$py" "$root/scripts/make_llama.py" "$OUT" "$root/README.md" "$root"/docs/*.md
common=(--model "$OUT/base" --data "$OUT/train.bin" --steps "$STEPS" --seq-len 64 --batch 2 --lr 1e-3)
for n in 2 4; do
  echo "== full shard at $n ranks"
  "$run" -n "$n" --deadline-s 600 "$tune" "${common[@]}" --ckpt "$OUT/ckpt$n" --save-every 10 \
      --out "$OUT/tuned$n" --logits "$OUT/logits$n.safetensors"
  "$py" "$root/tests/multirank/hf_check.py" model "$OUT/tuned$n" "$OUT/logits$n.safetensors" \
      "$OUT/logits$n.safetensors"
done
echo "== stopped at step $((STEPS / 2)) and resumed, at 2 ranks"
"$run" -n 2 --deadline-s 600 "$tune" "${common[@]}" --ckpt "$OUT/ckpt_resumed" --stop-at $((STEPS / 2))
"$run" -n 2 --deadline-s 600 "$tune" "${common[@]}" --ckpt "$OUT/ckpt_resumed" --resume --out "$OUT/resumed"
cmp "$OUT/resumed/model.safetensors" "$OUT/tuned2/model.safetensors"
echo "the resumed run's export equals the uninterrupted run's, byte for byte"
