#!/usr/bin/env bash
# Runs the auditor's fuzz target for a bounded time (default 60 s):
#   scripts/fuzz.sh [SECONDS]
# cargo-fuzz needs a nightly toolchain (rustup's, on these machines); it is
# installed into ~/.cargo/bin when missing. Without nightly the run is skipped
# with a message, since the auditor's property tests still run in `make test`.
set -euo pipefail
seconds=${1:-60}
cd "$(dirname "$0")/../rust/hag_audit/fuzz"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
	echo "fuzz: skipped: no nightly Rust toolchain (cargo fuzz needs one)"
	exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
	echo "fuzz: installing cargo-fuzz"
	cargo install -q cargo-fuzz --locked
fi
echo "fuzz: audit_stream for ${seconds} s"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# libFuzzer exits non-zero on a crash, leaving the input in artifacts/.
if ! cargo +nightly fuzz run audit_stream -- -max_total_time="$seconds" >"$log" 2>&1; then
	tail -40 "$log"
	echo "fuzz: audit_stream FAILED (crashing input under rust/hag_audit/fuzz/artifacts/)"
	exit 1
fi
grep -E '^Done' "$log"
