#!/usr/bin/env bash
# The whole test suite: formatting, lints (warnings are errors), and every crate's tests
# (unit, property, runtime integration, per-op reference checks, bad-input contract, CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "scripts/test.sh: cargo not found; install Rust 1.89+ (https://rustup.rs)" >&2
  exit 1
fi
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
# The C API tests compile examples/c with gcc/g++ and run them under valgrind.
missing=()
for tool in gcc g++ valgrind; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  echo "scripts/test.sh: installing ${missing[*]}" >&2
  apt-get update -qq && apt-get install -y -qq gcc g++ valgrind >/dev/null
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
# include/uniop.h is generated from the C API crate; fail when the committed one is stale.
cargo run --locked -q -p uniop-capi --features header --bin uniop-header -- --check
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"
# One closing line for the whole run (cargo prints one per test binary, the last often empty).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
