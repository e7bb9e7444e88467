"""PyTorch's own modes on the same GPT-style model as bench_modes, for bench/modes.sh.

Run with torchrun or flatshard-run. Modes: torch_ddp (DistributedDataParallel + AdamW),
torch_zero1 (DDP + ZeroRedundancyOptimizer(AdamW)), torch_fsdp2 (fully_shard on every
block and the root), torch_fsdp2_grad_op (the same with reshard_after_forward=False),
torch_hsdp (fully_shard over a 2-D mesh: sharded within groups of --group ranks,
replicated across them).
--recompute 1 recomputes every block in backward (PyTorch's activation checkpointing,
non-reentrant, as checkpoint_wrapper applies it before fully_shard or DDP).
Rank 0 prints: mode,world,params,step_ms,-,rss_growth_bytes (the largest over ranks).
"""
import argparse
import os
import sys
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class Attention(nn.Module):
    def __init__(self, dim, heads, fused=False):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, 2)
        shape = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = shape(q), shape(k), shape(v)
        if self.fused:  # GPTConfig::fused_attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, d))


class Block(nn.Module):
    def __init__(self, dim, heads, fused=False):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(dim, heads, fused), nn.LayerNorm(dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, dim, heads, layers, fused=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, fused) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    for name, default in [("layers", 6), ("dim", 256), ("heads", 8), ("vocab", 4096), ("context", 64),
                          ("batch", 4), ("steps", 6)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--phases", type=int, default=0, help="1: each rank prints its mean phase times")
    ap.add_argument("--recompute", type=int, default=0, help="1: every block recomputed in backward")
    ap.add_argument("--group", type=int, default=0, help="torch_hsdp: ranks per shard group")
    ap.add_argument("--freeze", default="", help="parameters whose name contains it are frozen (fine-tuning)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    before = rss("VmRSS:")
    torch.manual_seed(0)
    model = GPT(a.vocab, a.context, a.dim, a.heads, a.layers)
    params = sum(p.numel() for p in model.parameters())
    if a.freeze:
        for name, p in model.named_parameters():
            if a.freeze in name:
                p.requires_grad_(False)
    if a.recompute:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    if a.mode in ("torch_fsdp2", "torch_fsdp2_grad_op", "torch_hsdp"):
        from torch.distributed.fsdp import fully_shard
        reshard = a.mode != "torch_fsdp2_grad_op"
        mesh = None
        if a.mode == "torch_hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            if a.group <= 0 or world % a.group:
                sys.exit(f"peer_pytorch_modes: torch_hsdp needs --group G dividing the world size {world}")
            mesh = init_device_mesh("cpu", (world // a.group, a.group), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, fused=True)
        run = model
    else:
        # The strongest settings: gradients are views of the buckets (no copy in or out),
        # ZeRO's parameters views of its buckets, fused AdamW.
        run = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        if a.mode == "torch_zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer([p for p in run.parameters() if p.requires_grad],
                                          optimizer_class=torch.optim.AdamW,
                                          parameters_as_bucket_view=True, lr=3e-4, fused=True)
        else:
            opt = torch.optim.AdamW([p for p in run.parameters() if p.requires_grad], lr=3e-4, fused=True)
    g = torch.Generator().manual_seed(rank)
    total = 0.0
    phase = [0.0, 0.0, 0.0]  # forward (with the loss), backward, step and zero_grad
    for step in range(a.steps + 1):
        tokens = torch.randint(a.vocab, (a.batch, a.context + 1), generator=g)
        if step == 1:
            dist.barrier()
        start = time.perf_counter()
        logits = run(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        forwarded = time.perf_counter()
        loss.backward()
        backwarded = time.perf_counter()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        if step >= 1:
            total += end - start
            for i, (t0, t1) in enumerate([(start, forwarded), (forwarded, backwarded), (backwarded, end)]):
                phase[i] += t1 - t0
    if a.phases:
        f, b, s = (x / a.steps * 1e3 for x in phase)
        print(f"{a.mode} rank {rank} phases ms: forward {f:.1f}, backward {b:.1f}, step {s:.1f}",
              file=sys.stderr, flush=True)
    figures = torch.tensor([total / a.steps * 1e3, float(rss("VmHWM:") - before)], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{a.mode},{world},{params},{figures[0]:.1f},-,{figures[1]:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: under FSDP2 with activation checkpointing
    # a rank was seen aborting there ("terminate called without an active exception",
    # signal 6) after every figure had been reduced and printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
