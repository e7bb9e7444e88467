"""Reference files for FlatShard's Hugging Face tests, made with transformers and safetensors.

    python hf_reference.py OUT

OUT/llama        a small random LlamaForCausalLM (grouped-query attention, untied head, token
                 ids of its own: bos 90, eos [91, 92], pad 93), saved in fp32 as one
                 model.safetensors, with logits.safetensors: its logits on
                 OUT/tokens.safetensors, computed by transformers in fp32.
OUT/llama3_tied  the same shape with tied embeddings, Llama 3 rope scaling and 8 heads of
                 head_dim 8 on a width of 32, saved in bf16 and split over several files
                 (model.safetensors.index.json); its logits are transformers' in fp32 on the
                 bf16 weights.
OUT/dtypes.safetensors  one tensor per dtype FlatShard reads: value[i] = i % 7 - 3 (bool:
                 i % 2), in each dtype, plus an empty tensor and a scalar.
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
tokens = torch.randint(0, 96, (2, 12), dtype=torch.int64)
save_file({"tokens": tokens}, f"{out}/tokens.safetensors")


def logits_of(model):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().contiguous()


def make(name, dtype, max_shard_size, **kw):
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=3,
                      max_position_embeddings=64, attn_implementation="eager", **kw)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 and varied, so that a wrong norm weight shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5)
    d = f"{out}/{name}"
    model.to(dtype).save_pretrained(d, max_shard_size=max_shard_size)
    # What the files hold, computed in fp32: read back as transformers reads them (the
    # model in memory went through bf16 whole, its rotary frequencies included).
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    save_file({"logits": logits_of(model)}, f"{d}/logits.safetensors")


make("llama", torch.float32, "50MB", num_attention_heads=4, num_key_value_heads=2,
     tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=90, eos_token_id=[91, 92], pad_token_id=93)
make("llama3_tied", torch.bfloat16, "8KB", num_attention_heads=8, num_key_value_heads=8, head_dim=8,
     tie_word_embeddings=True,
     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})

i = torch.arange(30)
values = (i % 7 - 3)
dtypes = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8}
tensors = {k: (values + 3 if k == "u8" else values).to(t).reshape(5, 6) for k, t in dtypes.items()}
tensors["bool"] = (i % 2).bool().reshape(2, 15)
tensors["empty"] = torch.zeros(0, 4)
tensors["scalar"] = torch.tensor(2.5)
save_file(tensors, f"{out}/dtypes.safetensors", metadata={"made_by": "hf_reference.py"})
print("reference files in", out)
