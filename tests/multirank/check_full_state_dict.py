"""Reads a FlatShard full state dict with Python's torch.load and prints, per entry,
its name, shape and sum, sorted by name: the C++ test compares them with its own."""
import sys

import torch

state = torch.load(sys.argv[1], weights_only=True)
assert isinstance(state, dict), type(state)
for name in sorted(state):
    t = state[name]
    assert isinstance(t, torch.Tensor), name
    print(f"{name} {'x'.join(map(str, t.shape))} {t.double().sum().item():.9e}")
