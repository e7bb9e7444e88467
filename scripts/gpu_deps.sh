#!/usr/bin/env bash
# Gathers, on this (CPU) machine, what scripts/gpu.sh needs on a GPU machine that has
# CUDA, PyTorch, CMake and ninja but no package registry: the headers, libraries and
# CMake package files of fmt, nlohmann_json, zlib, GoogleTest and Thrust's C++ back end
# (the CPU step kernels; the toolkit's own Thrust serves the CUDA ones) from Debian's packages,
# and OpenSSL's libcrypto, laid out under .gpu-deps/usr as under /usr (so their CMake files
# find themselves).
# Copy .gpu-deps to the GPU machine along with the tree (about 10 MB).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" >/dev/null
deps="$root/.gpu-deps/usr"
rm -rf "$root/.gpu-deps"
arch="$(gcc -print-multiarch)"
copy() {  # copy PATH... into the mirror, links resolved
  for p in "$@"; do
    mkdir -p "$deps/$(dirname "${p#/usr/}")"
    cp -rL "$p" "$deps/${p#/usr/}"
  done
}
copy /usr/include/fmt /usr/lib/"$arch"/cmake/fmt /usr/lib/"$arch"/libfmt.so*
copy /usr/include/nlohmann /usr/share/cmake/nlohmann_json
copy /usr/include/zlib.h /usr/include/zconf.h /usr/lib/"$arch"/libz.so /usr/lib/"$arch"/libz.a
copy /usr/include/gtest /usr/include/gmock /usr/lib/"$arch"/cmake/GTest /usr/lib/"$arch"/libgtest*.a \
     /usr/lib/"$arch"/libgmock*.a
copy /usr/include/thrust /usr/include/cub
# OpenSSL's libcrypto (HMAC-SHA256 of the job secret): its headers, the multiarch ones
# merged in, and the library.
copy /usr/include/openssl /usr/lib/"$arch"/libcrypto.so*
cp -L /usr/include/"$arch"/openssl/* "$deps/include/openssl/"
du -sh "$root/.gpu-deps"
