#!/usr/bin/env bash
# Every way to communicate less, in one run: on the communication-bound GPT, bytes sent per
# step, step time and last loss for plain DDP, each hook, asynchronous and decentralized
# DDP (bench/comm_hooks.sh: direct copies, sockets, and sockets over throttled loopback);
# then Fashion-MNIST test accuracy after a fixed budget of epochs for the same variants
# (bench/comm_hooks_accuracy.sh); at each world size in $RANKS. Prints Markdown.
#   bench/less_communication.sh [BUILD_DIR]
#   RANKS (default "2 4"), LINKS (default "10gbit 1gbit"; throttling needs root, and is
#   skipped without it), EPOCHS (default 3), HOOKS (default: every variant)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RANKS="${RANKS:-2 4}" LINKS="${LINKS-10gbit 1gbit}" EPOCHS="${EPOCHS:-3}"
echo "## The communication-bound GPT"
echo
"$root/bench/comm_hooks.sh" "$@"
echo "## Fashion-MNIST"
echo
"$root/bench/comm_hooks_accuracy.sh" "$@"
