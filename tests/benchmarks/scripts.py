"""Loading a script of ``benchmarks/`` (not a package) as a module, for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@contextlib.contextmanager
def benchmark_script(name: str) -> Iterator[ModuleType]:
    """``benchmarks/<name>.py`` as a module, in ``sys.modules`` while in use (dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
