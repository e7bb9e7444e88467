"""A small random Llama (transformers' LlamaForCausalLM) and a token file, for the
fine-tuning recipe (scripts/finetune_llama.sh; docs/fine-tuning.md).

    python make_llama.py OUT TEXT...   # OUT/base: the model; OUT/train.bin: TEXT's bytes as
                                       # uint16 tokens (vocabulary 256), as nanoGPT writes them
"""
import os
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

out, texts = sys.argv[1], sys.argv[2:]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
LlamaForCausalLM(cfg).save_pretrained(f"{out}/base")
data = b"".join(open(t, "rb").read() for t in texts)
np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(f"{out}/train.bin")
print(f"{out}/base: {sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())} parameters; "
      f"{out}/train.bin: {len(data)} tokens")
