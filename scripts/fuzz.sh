#!/usr/bin/env bash
# Runs every cargo-fuzz target once for SECONDS each (default 180) in one process (libFuzzer's
# default; -jobs would fork workers that log to fuzz-N.log in the working directory), from the
# committed corpus, and records executions, seconds, coverage and crashes in results/fuzz.json
# (which `molt-run bench --reliability` gathers into results/reliability.json).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). The fuzz crate builds
# llama.cpp once (the library links it) in its own target directory ($MOLT_FUZZ_TARGET_DIR,
# default target/fuzz). New inputs go to a scratch corpus, not the committed one; a crash is
# left in tests/fuzz/artifacts/<target>/ — fix it, add the input to tests/fuzz/corpus/<target>/
# (the CI smoke replays it from then on) and set its crashes_open back to 0 by re-running.
#
# Sanitizer: none. Molt's parsers are safe Rust, so what the fuzzer looks for is a panic
# (overflow checks and debug assertions are on, -a), and without ASan each target runs several
# times faster on a shared 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-180}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(gguf kv_blob transplant_files ladder trace prompt_file chat_request)
fi
target_dir=${MOLT_FUZZ_TARGET_DIR:-target/fuzz}
export OMP_WAIT_POLICY=PASSIVE
for t in "${targets[@]}"; do
    cargo +nightly fuzz build --fuzz-dir tests/fuzz -s none -a --target-dir "$target_dir" "$t"
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
logs=$scratch/logs
mkdir -p "$logs"
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t" "tests/fuzz/artifacts/$t"
    echo "fuzzing $t for ${seconds}s" >&2
    start=$(date +%s.%N)
    set +e
    # The binary cargo-fuzz built, run directly: `cargo fuzz run` would rebuild first whenever
    # a source changed since the build above.
    "$target_dir/x86_64-unknown-linux-gnu/release/$t" "$scratch/$t" "tests/fuzz/corpus/$t" \
        -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 \
        -artifact_prefix="tests/fuzz/artifacts/$t/" >"$logs/$t.log" 2>&1
    rc=$?
    set -e
    end=$(date +%s.%N)
    echo "$t $rc $start $end" >>"$logs/index"
    tail -n 3 "$logs/$t.log" >&2
done
python3 - "$logs" <<'PY'
import json, os, re, sys
logs = sys.argv[1]
path = "results/fuzz.json"
rows = json.load(open(path)) if os.path.exists(path) else []
for line in open(os.path.join(logs, "index")):
    t, rc, start, end = line.split()
    text = open(os.path.join(logs, t + ".log"), errors="replace").read()
    execs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", text)
    covs = re.findall(r"\bcov: (\d+)", text)
    # libFuzzer stops at the first crash and writes it as an artifact.
    crashes = len(re.findall(r"Test unit written to", text))
    prev = next((r for r in rows if r["target"] == t), None)
    row = {
        "target": t,
        "execs": int(execs[-1]) if execs else 0,
        "seconds": round(float(end) - float(start), 1),
        # Found over every recorded run: a crash fixed since still counts as found.
        "crashes_found": crashes + (prev["crashes_found"] if prev else 0),
        "crashes_open": 1 if int(rc) != 0 else 0,
        "coverage": int(covs[-1]) if covs else None,
    }
    rows = [r for r in rows if r["target"] != t] + [row]
    print(json.dumps(row))
json.dump(rows, open(path, "w"), indent=2)
open(path, "a").write("\n")
PY
