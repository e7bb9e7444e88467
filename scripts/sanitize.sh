#!/usr/bin/env bash
# The test suite under sanitizers (a CI step: .ci/run calls it after the main suite).
#   asan: AddressSanitizer + UndefinedBehaviorSanitizer, the library and every test
#         binary (build-asan/); runs the unit tests (in one process), the multi-rank,
#         training, Hugging Face and launcher tests.
#   tsan: ThreadSanitizer on the scheduler: CPU streams, the communicator and the TCP
#         rings (build-tsan/); runs their unit and multi-rank tests.
#   tsan-training: ThreadSanitizer on the training tests too (every strategy, offload's
#         host step thread, checkpoints): about 13 more minutes on 2 cores, so not in CI.
#   scripts/sanitize.sh [asan|tsan|tsan-training|all]      (default: all)
# MPI is left out (Open MPI is not instrumented, and keeps allocations for the process's life).
# LibTorch itself is not instrumented: the options below keep the checks to our code
# (no container-overflow checks on LibTorch's vectors, no vptr checks on its classes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
what="${1:-all}"
"$root/scripts/setup.sh" >/dev/null
. "$root/scripts/env.sh"
torch_prefix="$("$FLATSHARD_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
jobs="$(nproc)"

# -O1 with line tables only (-g1), as the sanitizers' documentation suggests: stack traces
# keep their files and lines, and each translation unit that includes LibTorch compiles in
# about half the time of -O2 -g under AddressSanitizer.
configure() {  # dir flags
  cmake -S "$root" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DFLATSHARD_WITH_CUDA=OFF -DFLATSHARD_WITH_MPI=OFF -DFLATSHARD_BUILD_BENCH=OFF -DFLATSHARD_BUILD_EXAMPLES=OFF \
    -DCMAKE_CXX_FLAGS="$2" -DCMAKE_EXE_LINKER_FLAGS="$2" >/dev/null
}

if [[ "$what" == asan || "$what" == all ]]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer"
  flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  configure "$root/build-asan" "$flags"
  cmake --build "$root/build-asan" -j "$jobs" --target flatshard_unit_tests flatshard_multirank_tests \
    flatshard_training_tests flatshard_hf_tests flatshard_launcher_tests flatshard-run
  export ASAN_OPTIONS="detect_leaks=1:detect_container_overflow=0:detect_odr_violation=0:abort_on_error=0"
  export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  # The unit tests in one process (each alone, 319 processes would spend about 5 minutes
  # loading LibTorch under the sanitizer; together they take seconds), the rest one by one.
  timeout -k 10 900 "$root/build-asan/tests/flatshard_unit_tests" --gtest_brief=1
  (cd "$root/build-asan" && ctest --output-on-failure -j 1 -LE '^unit$' -E 'install\.|examples\.|bench\.')
fi

if [[ "$what" == tsan || "$what" == tsan-training || "$what" == all ]]; then
  echo "== ThreadSanitizer (streams, communicator, TCP rings)"
  flags="-fsanitize=thread -fno-omit-frame-pointer"
  configure "$root/build-tsan" "$flags"
  targets=(flatshard_unit_tests flatshard_multirank_tests flatshard-run)
  [[ "$what" == tsan-training ]] && targets+=(flatshard_training_tests)
  cmake --build "$root/build-tsan" -j "$jobs" --target "${targets[@]}"
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$root/scripts/tsan.supp"
  (cd "$root/build-tsan" && ctest --output-on-failure -j 1 -R '^(Stream|Collectives|Failures)\.')
  if [[ "$what" == tsan-training ]]; then
    echo "== ThreadSanitizer (training tests)"
    (cd "$root/build-tsan" && ctest --output-on-failure -j 1 -L '^training$')
  fi
fi
