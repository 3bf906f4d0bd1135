"""Builds uniop's C++ torch kernels against the torch installed here.

    python -m uniop.torch.build_kernels

A C++ extension binds to one torch build (its C++ ABI and symbols change between releases), so
it cannot ship inside uniop's abi3 wheel: ``scripts/python-env.sh`` runs this after installing
torch, and again whenever torch changes. The module lands next to this file with a stamp naming
the torch version it was built for; ``import uniop.torch`` loads it only when the stamp matches
(and the module is newer than its source) and otherwise keeps the pure-Python kernels (correct,
~2 µs slower per call), saying so once.

Plain g++ with the flags torch's own ``cpp_extension`` uses — no ninja or setuptools needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODULE = "_kernels"
SOURCE = HERE / "csrc" / "kernels.cpp"
STAMP = HERE / f"{MODULE}.torch-version"


def module_path() -> Path:
    return HERE / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def built_for_this_torch() -> bool:
    """Whether the module is built for the installed torch from the current source (a module older
    than its source may lack a function ``uniop.torch`` calls)."""
    out = module_path()
    return (
        out.exists()
        and STAMP.exists()
        and STAMP.read_text().strip() == torch.__version__
        and (not SOURCE.exists() or out.stat().st_mtime >= SOURCE.stat().st_mtime)
    )


def build(force: bool = False) -> Path:
    out = module_path()
    if built_for_this_torch() and not force:
        return out
    import torch.utils.cpp_extension as cpp_extension  # slow to import: only when building

    torch_lib = cpp_extension.library_paths()[0]
    cmd = [
        os.environ.get("CXX", "g++"),
        "-O2",
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-DTORCH_EXTENSION_NAME={MODULE}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
        "-o",
        str(out) + ".tmp",
    ]
    subprocess.run(cmd, check=True)
    os.replace(str(out) + ".tmp", out)
    STAMP.write_text(torch.__version__ + "\n")
    return out


if __name__ == "__main__":
    print(f"uniop: built {build(force='--force' in sys.argv)} for torch {torch.__version__}")
