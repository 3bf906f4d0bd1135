#!/usr/bin/env bash
# Creates (or reuses) the project venv .venv and installs the Python package into it:
# NumPy, pytest, maturin, PyTorch, transformers, matplotlib; then builds the extension module
# (maturin develop --profile python: crates/uniop-python → python/uniop/_native.abi3.so) and the C++
# torch kernels (python -m uniop.torch.build_kernels: g++ against the installed torch).
#
# PyPI's Linux torch wheel brings its CUDA libraries (~3 GB): torch does not import without them,
# even on a CPU-only machine, and PyTorch's CPU-only index is not reachable from CI.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${UNIOP_TORCH_SPEC:-torch>=2.6}"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
if ! "$py" -c "import numpy, pytest, maturin, torch, transformers, matplotlib" 2>/dev/null; then
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet numpy pytest maturin "$TORCH_SPEC" transformers matplotlib
fi
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin develop --profile python --quiet
# uniop's C++ torch kernels bind to this torch build (rebuilt only when torch or the source changes).
"$py" -m uniop.torch.build_kernels
"$py" -c "import uniop; print('uniop', len(uniop.ops()), 'ops ready in .venv')"
