#!/usr/bin/env bash
# Extra fitting text for the projector learning curve (`molt-run map-curve --extra-corpus`):
# text any fresh development machine already has, gathered at run time so no machine path
# is committed. Three files, each capped at BYTES (default 160 KB):
#   python.txt  the head of every top-level module of the installed Python standard library
#   rust.txt    the head of every crate's src/lib.rs in the local Cargo registry
#   man.txt     the man pages of common commands, rendered as plain text
# Each file is sorted by name, so the same machine gives the same corpus.
# Usage: scripts/toolchain-corpus.sh OUT_DIR [BYTES]
set -euo pipefail
out=${1:?usage: toolchain-corpus.sh OUT_DIR [BYTES]}
cap=${2:-160000}
per_file=4000
mkdir -p "$out"

# Appends the head of each file named on stdin to $1 until it holds $cap bytes.
take_heads() {
    local dest=$1
    : >"$dest"
    while IFS= read -r f; do
        [ "$(stat -c %s "$dest")" -ge "$cap" ] && break
        head -c "$per_file" "$f" | iconv -f utf-8 -t utf-8 -c >>"$dest" || true
        printf '\n\n' >>"$dest"
    done
}

if command -v python3 >/dev/null; then
    stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    find "$stdlib" -maxdepth 1 -name '*.py' | LC_ALL=C sort | take_heads "$out/python.txt"
fi
registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
if [ -d "$registry" ]; then
    find "$registry" -mindepth 4 -maxdepth 4 -path '*/src/lib.rs' | LC_ALL=C sort | take_heads "$out/rust.txt"
fi
if command -v man >/dev/null; then
    : >"$out/man.txt"
    for cmd in bash ls cp mv rm find grep sed awk tar gzip ssh scp git make gcc curl rsync ps top \
        kill chmod chown ln du df mount cron sort uniq cut tr xargs less diff patch head tail wc \
        tee env nice date sleep; do
        [ "$(stat -c %s "$out/man.txt")" -ge "$cap" ] && break
        MANWIDTH=80 man -P cat "$cmd" 2>/dev/null | col -b | head -c 12000 >>"$out/man.txt" || true
        printf '\n\n' >>"$out/man.txt"
    done
fi
wc -c "$out"/*.txt
