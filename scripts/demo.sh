#!/usr/bin/env bash
# The demo: fetch the ladder if missing, then answer a real prompt under a memory-pressure
# trace that drops the budget mid-answer, so the answer migrates tier0 -> tier1 -> tier2.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release
./target/release/molt-run fetch
./target/release/molt-run generate --trace traces/spike_mid_answer.json --max-tokens 96 \
  --prompt "${1:-Explain how an operating system reclaims memory from background apps, in two short paragraphs.}" \
  --out results/demo_answer.jsonl
