#!/usr/bin/env bash
# Creates .venv with PyTorch for benches/torch_peer.py (a large download; not needed for tests).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet torch numpy matplotlib
echo "ok: .venv/bin/python benches/torch_peer.py"
