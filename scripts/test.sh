#!/usr/bin/env bash
# The whole test suite: formatting, lints (warnings are errors), every crate's tests (unit,
# property, runtime integration, per-op reference checks, bad-input contract, CLI, C programs),
# then the Python package's tests (NumPy, torch.library, torch.compile, DDP, transformers) in the
# project venv that scripts/python-env.sh creates.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "scripts/test.sh: cargo not found; install Rust 1.89+ (https://rustup.rs)" >&2
  exit 1
fi
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
# The Python extension links no libpython (the interpreter provides the symbols), the same for
# cargo and maturin, so neither invalidates the other's build.
export PYO3_BUILD_EXTENSION_MODULE=1
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
./scripts/python-env.sh
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider python/tests 2>&1 | tee -a "$log" || status=$?
# One closing line for the whole run (cargo prints one line per test binary, pytest one in all).
awk '/^test result:/ { p += $4; f += $6 }
     /^[0-9]+ (passed|failed)/ { for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
