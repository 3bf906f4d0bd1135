"""The Python examples (``examples/python``) run as a user runs them, each in a fresh interpreter;
each checks its own claims, so a wrong result exits non-zero."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"


def run_example(name, *args, without_torch=False):
    """Runs ``examples/python/<name>`` with ``args`` (with torch unimportable if asked); returns its
    output after checking it exited 0."""
    path = str(EXAMPLES / name)
    # A None entry in sys.modules makes `import torch` raise ImportError, as if it were not installed.
    block = "sys.modules['torch'] = None; " if without_torch else ""
    code = f"import runpy, sys; {block}sys.argv = [{path!r}, *{list(args)!r}]; "
    code += f"runpy.run_path({path!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_numpy_example_needs_numpy_alone():
    out = run_example("numpy_ops.py", without_torch=True)
    assert "kv_cache_append + attention" in out and "uniop.UniopError" in out


def test_torch_example_trains_a_compiled_block():
    out = run_example("torch_model.py")
    assert "compiled block trained" in out and "autocast bf16" in out


@pytest.mark.parametrize("family", ["Llama", "Phi3"])
def test_hf_example_keeps_greedy_tokens(family):
    pytest.importorskip("transformers")
    out = run_example("hf_patch.py", "--family", family, "--layers", "2", "--new", "8")
    assert "8 of 8 the same" in out
