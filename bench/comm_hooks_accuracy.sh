#!/usr/bin/env bash
# Fashion-MNIST test accuracy after a fixed budget of epochs under DDP with each
# communication hook, asynchronous and decentralized, at 2 ranks (or each of $RANKS), with
# the bytes each rank sends per step and the seconds per epoch: what less communication
# costs in accuracy. Prints a Markdown table per world size.
#   bench/comm_hooks_accuracy.sh [BUILD_DIR]
#   HOOKS (default: none bf16 int8 power_sgd:4:0 top_k:0.01 async:1 decentralized:1;
#   bench/variants.sh), EPOCHS (default 3), RANKS (default 2)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
. "$root/bench/variants.sh"
build="${1:-$root/build}"
epochs="${EPOCHS:-3}"
for ranks in ${RANKS:-2}; do
  echo "Fashion-MNIST, the CNN of examples/train_fashion_mnist.cpp, DDP, $ranks ranks, batch 32 per rank, Adam 1e-3, $epochs epochs"
  echo
  echo "| variant | test accuracy % | vs none (points) | MB sent per step per rank | bytes: none / variant | s per epoch |"
  echo "|---|---:|---:|---:|---:|---:|"
  base_acc="" base_sent=""
  for hook in ${HOOKS:-none bf16 int8 power_sgd:4:0 top_k:0.01 async:1 decentralized:1}; do
    read -r -a extra <<< "$(variant_args "$hook")"
    last="$("$build/flatshard-run" -n "$ranks" "$build/examples/train_fashion_mnist" --mode ddp \
      --epochs "$epochs" "${extra[@]}" 2>/dev/null | sed -n 's/^\[rank 0\] //p' | grep 'test accuracy' | tail -1)" ||
      { echo "comm_hooks_accuracy.sh: failed: $hook ($ranks ranks)" >&2; continue; }
    # "epoch 3: test accuracy 90.12% (9012 of 10000), 80 s, 0.123 MB sent per step"
    read -r acc secs sent < <(sed -E 's/.*accuracy ([0-9.]+)%.*\), ([0-9]+) s, ([0-9.]+) MB.*/\1 \2 \3/' <<< "$last")
    [[ -n "$base_acc" ]] || { base_acc="$acc"; base_sent="$sent"; }
    awk -v h="$hook" -v a="$acc" -v b="$base_acc" -v s="$sent" -v bs="$base_sent" -v t="$secs" \
      'BEGIN { printf "| %s | %.2f | %+.2f | %.3f | %.1f | %d |\n", h, a, a - b, s, bs / s, t }'
  done
  echo
done
