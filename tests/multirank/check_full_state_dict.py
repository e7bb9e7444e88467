"""Reads a FlatShard full state dict with Python's torch.load and compares each entry,
element by element, with the raw little-endian fp32 values in REF_DIR/<name>.f32 (the
C++ test's single-process reference). Prints, sorted by name, each entry's name, shape
and largest absolute difference; the C++ test checks them."""
import os
import sys

import torch

state = torch.load(sys.argv[1], weights_only=True)
ref_dir = sys.argv[2]
assert isinstance(state, dict), type(state)
for name in sorted(state):
    t = state[name]
    assert isinstance(t, torch.Tensor), name
    with open(os.path.join(ref_dir, name + ".f32"), "rb") as f:
        ref = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    assert ref.numel() == t.numel(), (name, ref.numel(), t.numel())
    diff = (t.double().flatten() - ref.double()).abs().max().item()
    print(f"{name} {'x'.join(map(str, t.shape))} {diff:.9e}")
