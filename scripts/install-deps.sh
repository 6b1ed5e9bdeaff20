#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build Molt: cmake (llama.cpp's build) and
# clang/libclang-dev (bindgen in llama-cpp-sys-2). Idempotent: does nothing when present.
set -euo pipefail
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v clang >/dev/null 2>&1 || need+=(clang)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
