# Sourced by bench/comm_hooks.sh and bench/comm_hooks_accuracy.sh: a variant of data-parallel
# communication, as the command-line arguments of bench_modes and train_fashion_mnist.
#   none, bf16, int8[:CHUNK], top_k:RATIO, random_k:RATIO, power_sgd:RANK[:START]  a hook
#   async:S          FullyShardOptions::staleness S (asynchronous, updates S steps late)
#   decentralized:K  FullyShardOptions::decentralized_every K (ring-neighbour averaging)
variant_args() {
  case "$1" in
    async:*) echo "--staleness ${1#async:}" ;;
    decentralized:*) echo "--decentralized ${1#decentralized:}" ;;
    *) echo "--hook $1" ;;
  esac
}
