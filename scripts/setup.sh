#!/usr/bin/env bash
# Installs everything FlatShard's build, tests, benchmarks and examples need on a
# fresh Debian machine, and is quick when everything is already there.
#
#   scripts/setup.sh            # Debian packages + the pinned torch venv
#   . scripts/env.sh            # (sourced by the other scripts) sets FLATSHARD_* paths
#
# Heavy installs live outside the checkout, in $FLATSHARD_CACHE
# (default ~/.cache/flatshard), so a fresh clone on the same machine reuses them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
. "$here/env.sh"

log() { printf '[setup] %s\n' "$*"; }

# --- Debian packages -------------------------------------------------------------
debs=(cmake ninja-build g++ ccache pkg-config libfmt-dev libgtest-dev libgmock-dev
      libbenchmark-dev libthrust-dev python3-venv zlib1g-dev nlohmann-json3-dev
      dataset-fashion-mnist openmpi-bin libopenmpi-dev libssl-dev iproute2)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  log "Debian packages present"
fi

# --- pinned torch in a venv --------------------------------------------------------
stamp="$FLATSHARD_VENV/.flatshard-torch-$FLATSHARD_TORCH_VERSION"
if [[ -f "$stamp" ]]; then
  log "torch $FLATSHARD_TORCH_VERSION present in $FLATSHARD_VENV"
else
  log "creating $FLATSHARD_VENV with torch==$FLATSHARD_TORCH_VERSION (a large download, once)"
  mkdir -p "$FLATSHARD_CACHE"
  "${FLATSHARD_PYTHON:-python3}" -m venv "$FLATSHARD_VENV"
  "$FLATSHARD_VENV/bin/pip" install -q --upgrade pip
  "$FLATSHARD_VENV/bin/pip" install -q --cache-dir "$FLATSHARD_CACHE/pip" \
      "torch==$FLATSHARD_TORCH_VERSION" numpy matplotlib
  "$FLATSHARD_VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
  touch "$stamp"
fi
# The Python references of the Hugging Face tests (transformers' Llama, the safetensors
# package), pinned, into the same venv.
hf_pins=(transformers==5.24.0 safetensors==0.8.0)
hf_stamp="$FLATSHARD_VENV/.flatshard-hf-${hf_pins[0]#*==}-${hf_pins[1]#*==}"
if [[ -f "$hf_stamp" ]]; then
  log "${hf_pins[*]} present"
else
  log "installing ${hf_pins[*]} into $FLATSHARD_VENV"
  "$FLATSHARD_VENV/bin/pip" install -q --cache-dir "$FLATSHARD_CACHE/pip" "${hf_pins[@]}"
  "$FLATSHARD_VENV/bin/python" -c 'import transformers, safetensors; print("transformers", transformers.__version__)'
  touch "$hf_stamp"
fi
log "Torch cmake prefix: $("$FLATSHARD_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
