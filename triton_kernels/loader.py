"""Loads kernel source files in the Triton mode a device needs.

``@triton.jit`` decides between compiled and interpreted kernels when it decorates,
from ``TRITON_INTERPRET``. GPU tensors need the compiled kind and CPU tensors the
interpreted kind, whatever the environment said when ``triton`` was imported, so
:func:`kernels_module` loads ``kernels.py`` once per mode under its own module name.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
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


def load_kernels(path: str, name: str) -> ModuleType:
    """A kernel source file at ``path`` loaded as compiled kernels under module ``name``
    (e.g. a copy of ``kernels.py`` to compile for GPU targets)."""
    return _load(path, name, False)


def mode_name(interpret: bool) -> str:
    return "interpreted" if interpret else "compiled"


@functools.cache
def kernels_module(interpret: bool) -> ModuleType:
    """``kernels.py`` decorated as interpreted (``True``) or compiled kernels."""
    return _load(_KERNELS_FILE, f"fsdp_traceable.triton_kernels._kernels_{mode_name(interpret)}", interpret)
