"""The peer of bench_gpt_gpu: the same GPT-style model and training step under PyTorch
FSDP2 (fully_shard per block and at the root, bf16 compute, fp32 reduction, fp32 AdamW
state; fused AdamW where this torch supports it over FSDP2's sharded parameters, else
foreach), on one GPU with NCCL. --offload 1 adds FSDP2's CPUOffloadPolicy (pinned host
memory, the optimizer steps on the CPU). --mode ddp runs PyTorch DDP instead, as its users
run it in bf16: fp32 parameters, torch.autocast(bfloat16), gradient_as_bucket_view=True,
fused AdamW. --mode plain is the model with no wrapper at all (world 1 only: the ceiling of
any wrapper there), fp32 parameters under torch.autocast(bfloat16) and fused AdamW;
--compile 1 compiles it whole (plain) or each block before fully_shard (fsdp2, as
torchtitan does). Prints tokens/s, MFU and the caching allocator's
peak in the same form; scripts/gpu.sh runs both and prints the ratios.

    torchrun --nproc-per-node 1 bench/peer_fsdp2_gpu.py [--dim 2048 --layers 18 ...]
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from peer_pytorch_modes import GPT, Block  # the CPU peers' model (bench/), with fused attention here


def main():
    p = argparse.ArgumentParser()
    for name, default in [("dim", 2048), ("layers", 18), ("heads", 16), ("vocab", 32768), ("context", 1024),
                          ("batch", 4), ("warmup", 3), ("steps", 20)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--offload", type=int, default=0)
    p.add_argument("--recompute", type=int, default=0)
    p.add_argument("--csv", default="")
    p.add_argument("--mode", default="fsdp2", choices=["fsdp2", "ddp", "plain"])
    p.add_argument("--compile", type=int, default=0, help="torch.compile: the whole model (plain), each block (fsdp2)")
    p.add_argument("--tag", default="", help="appended to the CSV row's name after a dash")
    p.add_argument("--nccl-host-per-rank", action="store_true",
                   help="give each rank its own NCCL_HOSTID (ranks sharing one GPU, as flatshard-run's option)")
    p.add_argument("--profile", default="", help="Chrome trace of three more steps (torch.profiler)")
    a = p.parse_args()

    if a.nccl_host_per_rank:
        # As flatshard-run --nccl-host-per-rank: each rank its own NCCL host id, so that
        # NCCL joins ranks that share a GPU over its network transport.
        os.environ["NCCL_HOSTID"] = f"peer-{os.environ['MASTER_PORT']}-rank{os.environ['RANK']}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    model = GPT(a.vocab, a.context, a.dim, a.heads, a.layers, fused=True).cuda()
    params = sum(q.numel() for q in model.parameters())
    if a.mode == "plain":
        if world != 1:
            raise SystemExit("--mode plain is the unwrapped model: world 1 only")
        if a.recompute:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        if a.compile:
            model = torch.compile(model)
    elif a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        if a.recompute:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        model = DDP(model, device_ids=[local], gradient_as_bucket_view=True)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if a.recompute:  # activation checkpointing of every block (non-reentrant), as FSDP2 users apply it
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        offload = CPUOffloadPolicy(pin_memory=True) if a.offload else OffloadPolicy()
        if a.compile:
            for block in model.blocks:
                block.compile()
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mp_policy=mp, offload_policy=offload)
    opt, impl = None, ""
    for impl in ("fused", "foreach"):
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                    **{impl: True})
            break
        except (RuntimeError, TypeError) as e:
            print(f"AdamW({impl}=True) refused: {e}")

    tokens = torch.randint(a.vocab, (a.batch, a.context + 1), device="cuda")
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    # Host time per phase over the timed steps, as bench_gpt_gpu prints it.
    host_ms = [0.0, 0.0, 0.0]  # forward and loss, backward, step and zero_grad
    timing = [False]

    def phase(i, since):
        now = time.perf_counter()
        if timing[0]:
            host_ms[i] += (now - since) * 1000.0
        return now

    def step():
        since = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.mode in ("ddp", "plain")):
            logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(), y.reshape(-1))
        since = phase(0, since)
        loss.backward()
        since = phase(1, since)
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase(2, since)
        return loss

    for i in range(a.warmup):
        try:
            step()
        except (RuntimeError, TypeError) as e:  # fused steps refused at the first step
            if i or impl != "fused":
                raise
            print(f"AdamW(fused=True) failed at its first step ({e}); using foreach")
            impl = "foreach"
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=0.1, foreach=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    timing[0] = True
    for _ in range(a.steps):
        loss = step()
    timing[0] = False
    stop.record()
    stop.synchronize()
    ms = start.elapsed_time(stop)

    tokens_per_s = a.batch * a.context * world * a.steps / (ms / 1000.0)
    # As bench_gpt_gpu: 6 FLOPs per non-embedding parameter (the token and position tables
    # are lookups), attention's score and value products counted in full.
    flops_per_token = 6.0 * (params - (a.vocab + a.context) * a.dim) + 12.0 * a.layers * a.context * a.dim
    mfu = tokens_per_s / world * flops_per_token / (a.peak_tflops * 1e12)
    stats = torch.cuda.memory_stats()
    gib = 1024.0**3
    if rank == 0:
        print(f"pytorch {a.mode}{' + CPU offload' if a.offload else ''}{' + recompute' if a.recompute else ''} "
              f"(AdamW {impl}): {params / 1e9:.3f}B params, {tokens_per_s:.0f} tokens/s, MFU {100 * mfu:.1f}%, "
              f"peak {stats['allocated_bytes.all.peak'] / gib:.2f} GiB (reserved "
              f"{stats['reserved_bytes.all.current'] / gib:.2f} GiB, {stats['num_alloc_retries']} retries), "
              f"step {ms / a.steps:.1f} ms, loss {loss.item():.3f}")
        print(f"  host ms per step: forward {host_ms[0] / a.steps:.1f}, backward {host_ms[1] / a.steps:.1f}, "
              f"optimizer step {host_ms[2] / a.steps:.1f}")
        if a.csv:
            with open(a.csv, "a") as f:
                name = {"fsdp2": "fsdp2", "ddp": "pytorch-ddp", "plain": "pytorch-plain"}[a.mode]
                name += ("-compiled" if a.compile else "") + ("-offload" if a.offload else "")
                name += ("-recompute" if a.recompute else "") + (f"-{a.tag}" if a.tag else "")
                f.write(f"{name},{params},{tokens_per_s},{mfu},{stats['allocated_bytes.all.peak'] / gib},"
                        f"{stats['reserved_bytes.all.current'] / gib},{stats['num_alloc_retries']},"
                        f"{ms / a.steps},\n")  # no comm_wait: PyTorch does not report it
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(a.profile + (f".{rank}" if world > 1 else ""))
    dist.destroy_process_group()
    if not math.isfinite(loss.item()):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main()
