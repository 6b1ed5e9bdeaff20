#!/usr/bin/env bash
# The demo: fetch the ladder if missing, then answer a real prompt on every rung.
# (Mid-answer migration under a pressure trace arrives with the transplant and pressure
# work; until it lands this demo shows the ladder itself answering.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export OMP_WAIT_POLICY=PASSIVE
cargo build --release
./target/release/molt-run fetch
prompt="${1:-Explain how an operating system reclaims memory from background apps, in two short sentences.}"
mkdir -p results
: > results/demo_answers.jsonl
for rung in tier0 tier1 tier2; do
  echo "== $rung" >&2
  ./target/release/molt-run generate --rung "$rung" --max-tokens 96 --prompt "$prompt" --out /tmp/molt-demo.$$.jsonl
  cat /tmp/molt-demo.$$.jsonl >> results/demo_answers.jsonl
done
rm -f /tmp/molt-demo.$$.jsonl
