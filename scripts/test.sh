#!/usr/bin/env bash
# The test command: hermetic tests on tiny generated models, plus the real-ladder tests when
# the ladder has been fetched (set MOLT_REQUIRE_LADDER=1 to make its absence a failure, as CI
# does). Release profile on purpose: llama.cpp is then built once for the binary and the tests.
# Every test binary runs even after one fails, so a failure cannot hide the ones after it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export OMP_WAIT_POLICY=PASSIVE
# The whole workspace: the runtime library, the CLI, the server, the benchmarks and the examples
# (the CLI's tests run the `molt-run` binary, built first).
cargo build --release --workspace --all-targets
cargo test --release --workspace --no-fail-fast -- --test-threads=2 "$@"
