"""PyTorch's c10d Gloo backend on the same collectives and sizes as bench_collectives.

Run with torchrun (or flatshard-run) at the same world size; rank 0 prints one line
per (op, bytes): `c10d_gloo <op> <bytes> <ms per op> <MB/s>`.
"""
import os
import time

import torch
import torch.distributed as dist

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def iterations(nbytes):
    return 1000 if nbytes <= 64 << 10 else 200 if nbytes <= 1 << 20 else 20 if nbytes <= 16 << 20 else 8


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for op in ["all_gather", "reduce_scatter", "all_reduce"]:
        for nbytes in SIZES:
            numel = nbytes // 4
            slot = numel // world
            full = torch.ones(slot * world)
            mine = torch.ones(slot)
            def once():
                if op == "all_gather":
                    dist.all_gather_into_tensor(full, mine)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(mine, full)
                else:
                    dist.all_reduce(full)
            once()
            dist.barrier()
            n = iterations(nbytes)
            start = time.perf_counter()
            for _ in range(n):
                once()
            seconds = (time.perf_counter() - start) / n
            if rank == 0:
                print(f"c10d_gloo {op} {nbytes} {seconds * 1e3:.3f} {nbytes / seconds / 1e6:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
