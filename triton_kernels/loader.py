"""Loads kernel source files in the Triton mode a device needs.

``@triton.jit`` decides between compiled and interpreted kernels when it decorates,
from ``TRITON_INTERPRET``. GPU tensors need the compiled kind and CPU tensors the
interpreted kind, whatever the environment said when ``triton`` was imported, so
:func:`kernels_module` loads ``kernels.py`` once per mode under its own module name,
and :func:`load_generated` does the same for generated kernel files.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from types import ModuleType

import triton

_KERNELS_FILE = os.path.join(os.path.dirname(__file__), "kernels.py")


def _load(path: str, name: str, interpret: bool) -> ModuleType:
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def mode_name(interpret: bool) -> str:
    return "interpreted" if interpret else "compiled"


@functools.cache
def kernels_module(interpret: bool) -> ModuleType:
    """``kernels.py`` decorated as interpreted (``True``) or compiled kernels."""
    return _load(_KERNELS_FILE, f"triton_kernels._kernels_{mode_name(interpret)}", interpret)


def load_generated(source: str, stem: str, interpret: bool) -> ModuleType:
    """Writes ``source`` to a file named after its hash (Triton reads kernel source
    back from disk, so it must stay there) and loads it in the given mode.

    Args:
        source: a Python module defining ``@triton.jit`` kernels.
        stem: a short name for the file and module.
        interpret: whether to decorate the kernels as interpreted.

    Returns:
        The loaded module.
    """
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    directory = os.path.join(tempfile.gettempdir(), f"triton_kernels_{os.getuid()}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{stem}_{digest}.py")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return _load(path, f"triton_kernels._{stem}_{digest}_{mode_name(interpret)}", interpret)
