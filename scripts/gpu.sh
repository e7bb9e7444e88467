#!/usr/bin/env bash
# Everything the CUDA path needs a GPU for, in one run on a GPU machine:
#   1. builds FlatShard against that machine's own torch (and NCCL, from its toolkit or
#      torch's nvidia-nccl), with fmt, nlohmann_json, zlib and GoogleTest from .gpu-deps
#      (scripts/gpu_deps.sh makes it on a machine with Debian's packages; carry it along);
#   2. runs the GPU tests: the CUDA kernels, the Communicator at world 1 over NCCL,
#      FullyShard at world 1 over NCCL (fp32 and bf16) and at world 2 over TCP on one GPU,
#      each against single-process training;
#   3. benchmarks a 1B-parameter GPT (bf16) under FlatShard's full shard and PyTorch FSDP2
#      on the same GPU, one after the other: tokens/s, MFU and peak memory, with ratios.
# Logs and the CSV go to $OUT (the device tool's) or out/gpu. Extra arguments go to both
# benchmarks (e.g. --layers 18 --batch 4).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/out/gpu}"
mkdir -p "$out"
python="${FLATSHARD_GPU_PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
build="$root/build-gpu"
prefix="$torch_prefix"
[[ -d "$root/.gpu-deps/usr" ]] && prefix="$prefix;$root/.gpu-deps/usr"
arch_list="$("$python" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")')"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DFLATSHARD_WITH_CUDA=ON -DFLATSHARD_GPU_TESTS=ON -DFLATSHARD_BUILD_BENCH=OFF \
      -DFLATSHARD_BUILD_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES="${arch_list/./}" \
      > "$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
TORCH_CUDA_ARCH_LIST="$arch_list" cmake --build "$build" -j "$(nproc)" \
      --target flatshard_cuda_tests bench_gpt_gpu flatshard-run -- -k 0 > "$out/build.log" 2>&1 \
      || { grep -m 20 -B2 -A8 'error' "$out/build.log"; exit 1; }
echo "== GPU tests"
status=0
"$build/flatshard_cuda_tests" --gtest_brief=1 2>&1 | tee "$out/tests.log" || status=1

echo "== 1B GPT, bf16, one GPU: FlatShard full shard vs PyTorch FSDP2"
csv="$out/gpt_gpu.csv"
echo "impl,params,tokens_per_s,mfu,peak_gib,step_ms" > "$csv"
"$build/flatshard-run" -n 1 --deadline-s 900 "$build/bench_gpt_gpu" --csv "$csv" "$@" 2>&1 \
  | tee "$out/bench_flatshard.log" || status=1
"$python" -m torch.distributed.run --standalone --nproc-per-node 1 "$root/bench/peer_fsdp2_gpu.py" \
  --csv "$csv" "$@" 2>&1 | tee "$out/bench_fsdp2.log" || status=1
"$python" - "$csv" <<'PY' | tee "$out/table.md"
import csv, sys
rows = {r["impl"]: r for r in csv.DictReader(open(sys.argv[1]))}
print("| | params | tokens/s | MFU | peak GiB | step ms |")
print("|---|---|---|---|---|---|")
for name in ("flatshard", "fsdp2"):
    if name in rows:
        r = rows[name]
        print(f"| {name} | {int(r['params'])/1e9:.2f}B | {float(r['tokens_per_s']):.0f} | "
              f"{100*float(r['mfu']):.1f}% | {float(r['peak_gib']):.2f} | {float(r['step_ms']):.1f} |")
if len(rows) == 2:
    f, p = rows["flatshard"], rows["fsdp2"]
    print(f"| ratio flatshard/fsdp2 | | {float(f['tokens_per_s'])/float(p['tokens_per_s']):.2f} | | "
          f"{float(f['peak_gib'])/float(p['peak_gib']):.2f} | {float(f['step_ms'])/float(p['step_ms']):.2f} |")
PY
exit $status
