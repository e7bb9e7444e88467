# Sourced by FlatShard's scripts: where the cached venv and builds live.
: "${FLATSHARD_CACHE:=${XDG_CACHE_HOME:-$HOME/.cache}/flatshard}"
: "${FLATSHARD_TORCH_VERSION:=2.11.0}"
: "${FLATSHARD_VENV:=$FLATSHARD_CACHE/venv-torch-$FLATSHARD_TORCH_VERSION}"
export FLATSHARD_CACHE FLATSHARD_TORCH_VERSION FLATSHARD_VENV
