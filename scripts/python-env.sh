#!/usr/bin/env bash
# Creates (or reuses) the project venv .venv and installs the Python package into it:
# NumPy, pytest, maturin, PyTorch (CPU use), transformers, matplotlib; then builds the extension
# module (maturin develop --release: crates/uniop-python → python/uniop/_native.abi3.so).
#
# PyPI's Linux torch wheel depends on ~3 GB of CUDA wheels that a CPU run never loads; we install
# torch without them (its other requirements are installed from its own metadata), which keeps a
# fresh CI machine's download near 600 MB. A venv with the full CUDA set works just as well.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${UNIOP_TORCH_SPEC:-torch>=2.6}"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
if ! "$py" -c "import numpy, pytest, maturin, torch, transformers, matplotlib" 2>/dev/null; then
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet numpy pytest maturin transformers matplotlib
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install --quiet --no-deps "$TORCH_SPEC"
    "$py" - <<'PY' > .venv/torch-requirements.txt
import importlib.metadata as md
from packaging.requirements import Requirement
for line in md.requires("torch") or []:
    req = Requirement(line)
    gpu = req.name.startswith(("nvidia", "cuda", "triton"))
    if not gpu and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(req)
PY
    "$py" -m pip install --quiet -r .venv/torch-requirements.txt
  fi
fi
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin develop --release --quiet
"$py" -c "import uniop; print('uniop', len(uniop.ops()), 'ops ready in .venv')"
