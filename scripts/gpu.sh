#!/usr/bin/env bash
# Everything the CUDA path needs a GPU for, in one run on a GPU machine:
#   1. builds FlatShard against that machine's own torch (and NCCL, from its toolkit or
#      torch's nvidia-nccl), with fmt, nlohmann_json, zlib, GoogleTest and OpenSSL from .gpu-deps
#      (scripts/gpu_deps.sh makes it on a machine with Debian's packages; carry it along);
#   2. runs the GPU tests: the CUDA kernels, the Communicator at world 1 over NCCL,
#      FullyShard at world 1 over NCCL (fp32 and bf16) and at world 2 over TCP on one GPU,
#      each against single-process training; then every multi-rank test again at worlds
#      1-4 over NCCL, each rank with its own NCCL host id (flatshard-run
#      --nccl-host-per-rank), with freed buffers poisoned (FLATSHARD_GPU_NCCL_WORLDS=0
#      skips that pass);
#   3. benchmarks a 1B-parameter GPT (bf16) under FlatShard's full shard and PyTorch FSDP2
#      on the same GPU, alternating (FLATSHARD_GPU_RUNS runs each, default 5, of 5 warm-up
#      and 50 timed steps; the NCCL worlds FLATSHARD_GPU_WORLD_RUNS, default 2; the table
#      gives medians): tokens/s, MFU, peak allocated and reserved memory, allocator
#      retries, with ratios; then both with every block recomputed (FLATSHARD_GPU_RECOMPUTE=0
#      skips it) and with CPU offload (FLATSHARD_GPU_OFFLOAD=0 skips it; FlatShard's once
#      more sending fp32 masters instead of bf16 copies, FLATSHARD_GPU_OFFLOAD_FP32=0 skips
#      that, once stepping in backward, FLATSHARD_GPU_OFFLOAD_STEP=0 skips that, both with
#      expandable segments, FLATSHARD_GPU_EXPANDABLE=0 skips those, and its DDP
#      offloaded, which FLATSHARD_GPU_DDP=0 skips); FlatShard's DDP
#      against PyTorch DDP (FLATSHARD_GPU_DDP=0 skips it); and at batch 1, where the model's
#      states set the peak at the end of backward, FlatShard's full shard with and without
#      stepping in backward against FSDP2 (FLATSHARD_GPU_STATES=0 skips it).
# Logs and the CSV go to $OUT (when set) or out/gpu. Extra arguments go to both
# benchmarks (e.g. --layers 18 --batch 4). FLATSHARD_GPU_BUILD_ONLY=1 stops after the build
# (scripts/gpu_profile.sh uses it); FLATSHARD_GPU_BENCH=0 stops after the tests, and
# FLATSHARD_GPU_TESTS=0 skips them, so that one run can build and test and a later
# one (the build kept) benchmark.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/out/gpu}"
mkdir -p "$out"
python="${FLATSHARD_GPU_PYTHON:-python3}"
runs="${FLATSHARD_GPU_RUNS:-5}"
world_runs="${FLATSHARD_GPU_WORLD_RUNS:-2}"
# World 1: 5 warm-up and 50 timed steps; the NCCL worlds (every step crosses loopback
# sockets, seconds each): a six-block GPT (0.44B, so that four DDP replicas fit 80 GB),
# 2 warm-up and 8 timed steps. Arguments given to this script come after, and win.
w1=(--warmup 5 --steps 50 "$@")
wn=(--layers 6 --warmup 2 --steps 8 "$@")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
build="$root/build-gpu"
prefix="$torch_prefix"
# fmt, nlohmann_json, GoogleTest and the rest come from .gpu-deps, copied along with the
# tree (a GPU machine without network access cannot fetch them): say so at once, not
# only as a find_package error at the configure log's end.
if [[ -d "$root/.gpu-deps/usr" ]]; then
  prefix="$prefix;$root/.gpu-deps/usr"
else
  echo "gpu.sh: no .gpu-deps/usr: unless this machine has fmt, nlohmann_json, GoogleTest, zlib and OpenSSL" \
       "installed, run scripts/gpu_deps.sh where Debian's packages are and copy .gpu-deps along with the tree" >&2
fi
arch_list="$("$python" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")')"
# No compiler cache: on a GPU machine that starts with no build state, a cache would only
# cost its writes.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DFLATSHARD_WITH_CUDA=ON -DFLATSHARD_GPU_TESTS=ON -DFLATSHARD_WITH_MPI=OFF -DFLATSHARD_BUILD_BENCH=OFF -DFLATSHARD_CCACHE=OFF \
      -DFLATSHARD_BUILD_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES="${arch_list/./}" \
      > "$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
TORCH_CUDA_ARCH_LIST="$arch_list" cmake --build "$build" -j "$(nproc)" \
      --target flatshard_cuda_tests bench_gpt_gpu flatshard-run -- -k 0 > "$out/build.log" 2>&1 \
      || { grep -m 20 -B2 -A8 'error' "$out/build.log"; exit 1; }
[[ "${FLATSHARD_GPU_BUILD_ONLY:-0}" == 1 ]] && exit 0
status=0
if [[ "${FLATSHARD_GPU_TESTS:-1}" == 1 ]]; then
  echo "== GPU tests"
  "$build/flatshard_cuda_tests" --gtest_brief=1 2>&1 | tee "$out/tests.log" || status=1
  # The same tests with NCCL between ranks on the one GPU (each rank its own NCCL host id:
  # Note [NCCL between ranks on one GPU]): the multi-rank ones at worlds 1-4 over NCCL,
  # hybrid at world 4 in groups of 2, checkpoints loaded at worlds 1, 3 and 4, a stuck
  # rank aborted by the watchdog; every freed flat buffer poisoned with NaN (Note [Buffers
  # a collective touches]). FLATSHARD_GPU_NCCL_WORLDS=0 skips this pass.
  if [[ "${FLATSHARD_GPU_NCCL_WORLDS:-1}" == 1 ]]; then
    echo "== GPU tests at worlds 1-4 over NCCL, freed buffers poisoned"
    FLATSHARD_TEST_NCCL_HOST_PER_RANK=1 FLATSHARD_POISON_FREED=1 "$build/flatshard_cuda_tests" --gtest_brief=1 \
      2>&1 | tee "$out/tests_nccl_worlds.log" || status=1
  fi
fi
[[ "${FLATSHARD_GPU_BENCH:-1}" == 1 ]] || exit $status

echo "== 1B GPT, bf16, one GPU: FlatShard full shard vs PyTorch FSDP2 (alternating, $runs runs each), then with CPU offload"
csv="$out/gpt_gpu.csv"
echo "impl,params,tokens_per_s,mfu,peak_gib,reserved_gib,retries,step_ms,comm_wait" > "$csv"
for ((i = 0; i < runs; ++i)); do
  "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" "${w1[@]}" 2>&1 \
    | tee -a "$out/bench_flatshard.log" || status=1
  (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py \
    --csv "$csv" "${w1[@]}") 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" | tee -a "$out/bench_fsdp2.log" || status=1
done
# At world 1 the honest peer is no wrapper at all: plain PyTorch (fp32 parameters under
# autocast(bf16), fused AdamW), eager and compiled, and FSDP2 with each block compiled as
# torchtitan runs it (FLATSHARD_GPU_PLAIN=0 skips these).
if [[ "${FLATSHARD_GPU_PLAIN:-1}" == 1 ]]; then
  for ((i = 0; i < runs; ++i)); do
    for extra in "--mode plain --compile 0" "--mode plain --compile 1" "--mode fsdp2 --compile 1"; do
      # shellcheck disable=SC2086
      (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py \
        --csv "$csv" $extra "${w1[@]}") 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" \
        | tee -a "$out/bench_fsdp2.log" || status=1
    done
  done
fi
# Where both sides communicate: worlds 2 and 4 on the one GPU, FlatShard and FSDP2 (and
# both DDPs) over NCCL with per-rank host ids, so every collective crosses NCCL's network
# transport (FLATSHARD_GPU_WORLDS="" skips; rows are tagged w2, w4). The ranks share one
# GPU's SMs and memory: these rows compare the engines' communication and overlap, not a
# cluster's throughput.
for w in ${FLATSHARD_GPU_WORLDS-2 4}; do
  for ((i = 0; i < world_runs; ++i)); do
    for mode in full ddp; do
      peer_mode="$mode"
      [[ "$mode" == full ]] && peer_mode=fsdp2
      "$build/flatshard-run" -n "$w" --nccl-host-per-rank --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" \
        --mode "$mode" --tag "w$w" "${wn[@]}" 2>&1 | tee -a "$out/bench_flatshard.log" || status=1
      (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node "$w" \
        peer_fsdp2_gpu.py --nccl-host-per-rank --csv "$csv" --mode "$peer_mode" --tag "w$w" "${wn[@]}") 2>&1 \
        | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" | tee -a "$out/bench_fsdp2.log" || status=1
    done
  done
done
# DDP, both: FlatShard's (bf16 parameters, fp32 all-reduce and masters) against PyTorch
# DDP with autocast(bf16), gradient_as_bucket_view and fused AdamW (FLATSHARD_GPU_DDP=0 skips).
if [[ "${FLATSHARD_GPU_DDP:-1}" == 1 ]]; then
  "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --mode ddp "${w1[@]}" 2>&1 \
    | tee -a "$out/bench_flatshard.log" || status=1
  (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py \
    --csv "$csv" --mode ddp "${w1[@]}") 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" | tee -a "$out/bench_fsdp2.log" || status=1
fi
# Batch 1: the activations are small beside 16 bytes per parameter of fp32 states, so the
# peak falls at the end of backward, when every unit's fp32 gradient shard exists (FSDP2's
# too); stepping in backward (fully-shard.md#stepping-in-backward) frees each as its unit
# steps. The planner predicts 0.87x the peak for the 1.04B GPT (flatshard-plan --step-in-backward 1).
if [[ "${FLATSHARD_GPU_STATES:-1}" == 1 ]]; then
  for in_backward in 0 1; do
    "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --batch 1 --tag b1 \
      --step-in-backward "$in_backward" "${w1[@]}" 2>&1 | tee -a "$out/bench_flatshard.log" || status=1
  done
  (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py \
    --csv "$csv" --batch 1 --tag b1 "${w1[@]}") 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" \
    | tee -a "$out/bench_fsdp2.log" || status=1
fi
# Activation recomputation of every block, both (FSDP2: non-reentrant activation
# checkpointing of each block).
if [[ "${FLATSHARD_GPU_RECOMPUTE:-1}" == 1 ]]; then
  "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --recompute 1 "${w1[@]}" 2>&1 \
    | tee -a "$out/bench_flatshard.log" || status=1
  (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py \
    --csv "$csv" --recompute 1 "${w1[@]}") 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" \
    | tee -a "$out/bench_fsdp2.log" || status=1
fi
# CPU offload: the optimizer steps on the host, on every core (flatshard-run and torchrun
# would otherwise give the one rank a single thread).
if [[ "${FLATSHARD_GPU_OFFLOAD:-1}" == 1 ]]; then
  export OMP_NUM_THREADS="$(nproc)"
  "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --offload 1 "${w1[@]}" 2>&1 \
    | tee -a "$out/bench_flatshard.log" || status=1
  (cd "$root/bench" && "$python" -m torch.distributed.run --standalone --nproc-per-node 1 peer_fsdp2_gpu.py \
    --csv "$csv" --offload 1 "${w1[@]}") 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" \
    | tee -a "$out/bench_fsdp2.log" || status=1
  # The same with the fp32 masters sent to the GPU instead of their bf16 copies
  # (FullyShardOptions::offload_bf16_copy): what the copies save.
  if [[ "${FLATSHARD_GPU_OFFLOAD_FP32:-1}" == 1 ]]; then
    "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --offload 1 --bf16-copy 0 \
      --tag fp32send "${w1[@]}" 2>&1 | tee -a "$out/bench_flatshard.log" || status=1
  fi
  # Stepping in backward, offloaded: each unit steps on the host beside the rest of backward
  # (Note [Offloaded steps beside backward]).
  if [[ "${FLATSHARD_GPU_OFFLOAD_STEP:-1}" == 1 ]]; then
    "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --offload 1 \
      --step-in-backward 1 "${w1[@]}" 2>&1 | tee -a "$out/bench_flatshard.log" || status=1
  fi
  # Both once more with the caching allocator's expandable segments, which both libraries'
  # allocators read from the environment: offloaded, FlatShard's fixed-size segments
  # fragment (reserved 10.5 GiB against FSDP2's 7.9 at the same allocated peak on an H100),
  # and these remove it (FLATSHARD_GPU_EXPANDABLE=0 skips them).
  if [[ "${FLATSHARD_GPU_EXPANDABLE:-1}" == 1 ]]; then
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$build/flatshard-run" -n 1 --deadline-s 900 \
      "$build/bench_gpt_gpu" --csv "$csv" --offload 1 --tag expseg "${w1[@]}" 2>&1 | tee -a "$out/bench_flatshard.log" \
      || status=1
    (cd "$root/bench" && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$python" -m torch.distributed.run \
      --standalone --nproc-per-node 1 peer_fsdp2_gpu.py --csv "$csv" --offload 1 --tag expseg "${w1[@]}") 2>&1 \
      | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*" | tee -a "$out/bench_fsdp2.log" || status=1
  fi
  # FlatShard's DDP offloaded (ZeRO-Offload's layout without sharding): no PyTorch peer
  # offloads DDP; the table sets it against FlatShard's DDP on the GPU.
  if [[ "${FLATSHARD_GPU_DDP:-1}" == 1 ]]; then
    "$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" --mode ddp --offload 1 \
      "${w1[@]}" 2>&1 | tee -a "$out/bench_flatshard.log" || status=1
  fi
fi
"$python" - "$csv" <<'PY' | tee "$out/table.md"
import csv, statistics, sys
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    rows.setdefault(r["impl"], []).append(r)
def med(impl, key):
    return statistics.median(float(r[key]) for r in rows[impl])
def wait(impl):  # Note [Communication wait]; the peers do not report it
    shares = [float(r["comm_wait"]) for r in rows[impl] if r.get("comm_wait")]
    return f"{100 * statistics.median(shares):.1f}%" if shares else "-"
print("| | params | tokens/s | MFU | peak alloc GiB | reserved GiB | retries | step ms | comm wait | runs |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in ("flatshard", "fsdp2", "flatshard-ddp", "pytorch-ddp", "flatshard-recompute", "fsdp2-recompute",
             "flatshard-offload", "fsdp2-offload", "flatshard-offload-fp32send", "flatshard-stepinbwd-offload",
             "flatshard-offload-expseg", "fsdp2-offload-expseg",
             "flatshard-ddp-offload", "flatshard-b1", "flatshard-stepinbwd-b1",
             "fsdp2-b1", "pytorch-plain", "pytorch-plain-compiled", "fsdp2-compiled", "flatshard-w2", "fsdp2-w2", "flatshard-ddp-w2", "pytorch-ddp-w2",
             "flatshard-w4", "fsdp2-w4", "flatshard-ddp-w4", "pytorch-ddp-w4"):
    if name in rows:
        print(f"| {name} | {int(rows[name][0]['params'])/1e9:.2f}B | {med(name, 'tokens_per_s'):.0f} | "
              f"{100*med(name, 'mfu'):.1f}% | {med(name, 'peak_gib'):.2f} | {med(name, 'reserved_gib'):.2f} | "
              f"{max(int(r['retries']) for r in rows[name])} | {med(name, 'step_ms'):.1f} | {wait(name)} | "
              f"{len(rows[name])} |")
if "flatshard" in rows and "fsdp2" in rows:
    print(f"| ratio flatshard/fsdp2 | | {med('flatshard', 'tokens_per_s')/med('fsdp2', 'tokens_per_s'):.2f} | | "
          f"{med('flatshard', 'peak_gib')/med('fsdp2', 'peak_gib'):.2f} | "
          f"{med('flatshard', 'reserved_gib')/med('fsdp2', 'reserved_gib'):.2f} | | "
          f"{med('flatshard', 'step_ms')/med('fsdp2', 'step_ms'):.2f} | | |")
for f, p, what in (("flatshard-ddp", "pytorch-ddp", "DDP against PyTorch DDP"),
                   ("flatshard-recompute", "fsdp2-recompute", "both recomputed"),
                   ("flatshard-offload", "fsdp2-offload", "both offloaded"),
                   ("flatshard-offload-fp32send", "fsdp2-offload", "both offloaded, FlatShard sending fp32 masters"),
                   ("flatshard-offload", "flatshard-offload-fp32send", "offloaded, bf16 copies against fp32 masters sent"),
                   ("flatshard-stepinbwd-offload", "fsdp2-offload", "both offloaded, FlatShard stepping in backward"),
                   ("flatshard-offload-expseg", "fsdp2-offload-expseg", "both offloaded, expandable segments"),
                   ("flatshard-ddp-offload", "flatshard-ddp", "FlatShard DDP offloaded against on the GPU"),
                   ("flatshard-b1", "fsdp2-b1", "batch 1"),
                   ("flatshard", "pytorch-plain", "full shard against no wrapper, world 1"),
                   ("flatshard", "pytorch-plain-compiled", "full shard against no wrapper compiled, world 1"),
                   ("flatshard", "fsdp2-compiled", "full shard against FSDP2 with compiled blocks"),
                   ("flatshard-w2", "fsdp2-w2", "world 2 over NCCL, full shard"),
                   ("flatshard-ddp-w2", "pytorch-ddp-w2", "world 2 over NCCL, DDP"),
                   ("flatshard-w4", "fsdp2-w4", "world 4 over NCCL, full shard"),
                   ("flatshard-ddp-w4", "pytorch-ddp-w4", "world 4 over NCCL, DDP"),
                   ("flatshard-stepinbwd-b1", "fsdp2-b1", "batch 1, FlatShard stepping in backward")):
    if f not in rows or p not in rows:
        continue
    print(f"| ratio, {what} | | {med(f, 'tokens_per_s')/med(p, 'tokens_per_s'):.2f} | | "
          f"{med(f, 'peak_gib')/med(p, 'peak_gib'):.2f} | {med(f, 'reserved_gib')/med(p, 'reserved_gib'):.2f} | | "
          f"{med(f, 'step_ms')/med(p, 'step_ms'):.2f} | | |")
PY
exit $status
