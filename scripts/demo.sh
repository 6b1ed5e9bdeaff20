#!/usr/bin/env bash
# The demo: install what the build needs, build, fetch the ladder if missing, make sure the
# shipped projectors match the local rungs (refit only if they do not), then answer a real
# prompt under a replayed pressure trace that lands mid-answer: the answer starts on tier0
# and is carried down the ladder between two tokens, the precision rungs first (q3km, then
# tier1: the same weights, KV cache mapped per channel), then tier2 (the size route: the
# destination reads the positions the question looked at natively, nothing projected).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export OMP_WAIT_POLICY=PASSIVE
cargo build --release
./target/release/molt-run fetch
./target/release/molt-run train-projectors --if-stale
prompt="${1:-Explain how an operating system reclaims memory from background apps, then write a short Python function that reports the free memory.}"
trace="${MOLT_DEMO_TRACE:-traces/spike_mid_answer.json}"
mkdir -p results
echo "== trace: $trace" >&2
./target/release/molt-run generate --max-tokens 160 --trace "$trace" --prompt "$prompt" --out results/demo_answer.jsonl
echo "== switches (from results/demo_answer.jsonl)" >&2
python3 - <<'PY'
import json
row = json.loads(open("results/demo_answer.jsonl").readline())
print("rungs used:", " -> ".join(row["rungs_used"]))
for s in row["switches"]:
    print(f"  before token {s['at_token']}: {s['from']} -> {s['to']} ({s['method']}) "
          f"{s['cost_ms']:.1f} ms (load {s['load_ms']:.0f} ms apart), "
          f"{s['cells']} cells, FLOPs avoided {100 * (1 - s['flops'] / s['flops_reprefill']):.2f}%")
print(f"TTFT {row['ttft_ms']:.0f} ms, {row['tokens']} tokens, {row['tokens_per_s']:.1f} tok/s")
PY
