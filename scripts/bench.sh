#!/usr/bin/env bash
# The benchmark, end to end: install what the build needs, build, fetch the ladder if missing,
# make sure the shipped projectors match the local rungs, fit the ablation and top-k maps the
# conditions arms need (skipped when they are present and bound to these rungs), run every
# benchmark program, then draw the figures and write the results page (results/README.md) and
# the top README's results table from the JSON they wrote. About two hours on 2 cores;
# run it on a quiet machine (timings are compared side by side, but a loaded machine widens
# the spread). Pass `--quick` for one repetition and three prompts (a smoke run, ~20 min).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export OMP_WAIT_POLICY=PASSIVE
cargo build --release
run=./target/release/molt-run
$run fetch
$run train-projectors --if-stale
if ! ls projectors/qwen2.5-coder/ablations/*.topk6.molt-hmap >/dev/null 2>&1 \
    || ! ls projectors/qwen2.5-coder/ablations/*.per-head.molt-proj >/dev/null 2>&1; then
    # Rewrites results/projector_residuals.json with every variant's residuals.
    $run train-projectors --ablations --topk 2,4,6
fi
reps=3
prompts=()
if [[ "${1:-}" == "--quick" ]]; then
    reps=1
    prompts=(--prompts 3)
fi
arms=A,B,C,D,D-no-sandwich,D-no-remap,D-truncate,D-no-diagonal,D-dense,D-per-head,D-topk2,D-topk4,D-topk6,D-tail8,D-no-head,D-refill32
$run bench --conditions "$arms" --reps "$reps" "${prompts[@]}"
$run bench --cost-sweep --reps "$reps" --tails 8,32
# llama.cpp's own llama-bench as the speed peer (same sources and flags); without it --speed
# still compares against the llama-cpp-2 safe API and says the peer is absent.
scripts/llama-tools.sh >/dev/null || echo "== llama-tools did not build: bench --speed runs without its peer" >&2
$run bench --speed --reps "$reps"
$run bench --footprint
$run bench --serve-qos
$run figures
echo "== results page: results/README.md; figures: results/figures/" >&2
