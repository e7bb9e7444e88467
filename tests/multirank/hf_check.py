"""Checks what FlatShard wrote, with transformers and safetensors.

    python hf_check.py model DIR LOGITS TOKENS [SOURCE]
                                              # DIR loads with AutoModelForCausalLM; its logits
                                              # on TOKENS match LOGITS (FlatShard's); prints the
                                              # largest difference. With SOURCE (the model it
                                              # was tuned from): DIR's token ids, in its config
                                              # and its generation config, are SOURCE's
    python hf_check.py dtypes FILE               # FILE holds hf_reference.py's dtype tensors
    python hf_check.py rope DIR OUT              # transformers' rotary inverse frequencies for
                                              # DIR's config.json, into OUT (inv_freq)
"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

what = sys.argv[1]
if what == "model":
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    expected = load_file(sys.argv[3])["logits"]
    tokens = load_file(sys.argv[4])["tokens"]  # may be the same file
    with torch.no_grad():
        got = model(input_ids=tokens).logits
    diff = (got - expected).abs().max().item()
    print(f"max_abs_diff {diff:.3e} scale {expected.abs().max().item():.3e}")
    if len(sys.argv) > 5:
        from transformers import AutoConfig, GenerationConfig

        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        source, exported = AutoConfig.from_pretrained(sys.argv[5]), AutoConfig.from_pretrained(sys.argv[2])
        for k in ids:
            assert getattr(exported, k) == getattr(source, k), (k, getattr(exported, k), getattr(source, k))
        want = GenerationConfig.from_pretrained(sys.argv[5])
        for k in ids:
            assert getattr(model.generation_config, k) == getattr(want, k), (k, getattr(model.generation_config, k))
        print("token ids", [getattr(exported, k) for k in ids])
    sys.exit(0 if diff <= 1e-5 else 1)
elif what == "dtypes":
    with safe_open(sys.argv[2], framework="pt") as f:
        assert f.metadata() == {"format": "pt", "written_by": "flatshard"}, f.metadata()
    tensors = load_file(sys.argv[2])
    values = torch.arange(30) % 7 - 3
    dtypes = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
              "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8}
    for k, t in dtypes.items():
        want = (values + 3 if k == "u8" else values).to(t).reshape(5, 6)
        assert tensors[k].dtype == t and torch.equal(tensors[k], want), k
    assert torch.equal(tensors["bool"], (torch.arange(30) % 2).bool().reshape(2, 15))
    assert tensors["empty"].shape == (0, 4) and tensors["scalar"].item() == 2.5 and tensors["scalar"].dim() == 0
    print("dtypes ok", len(tensors))
elif what == "rope":
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(AutoConfig.from_pretrained(sys.argv[2]))
    assert rotary.attention_scaling == 1.0, rotary.attention_scaling
    save_file({"inv_freq": rotary.inv_freq.float().contiguous()}, sys.argv[3])
    print("rope", rotary.inv_freq.numel())
else:
    sys.exit(f"unknown check {what}")
