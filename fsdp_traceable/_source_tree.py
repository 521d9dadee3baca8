"""Makes ``fsdp_traceable.triton_kernels`` importable from a source tree.

The Triton kernels live in the repository's top-level ``triton_kernels/`` folder and
install as ``fsdp_traceable.triton_kernels`` (``package-dir`` in ``pyproject.toml``;
``triton_kernels`` alone is the import name of other packages too). A wheel holds them
inside the package. A source tree used in place (on ``PYTHONPATH``, or installed
editable) has no such folder inside the package, so importing this module puts a finder
for that one name in front of the import system; it does nothing elsewhere.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.dirname(_PACKAGE_DIR)
_SUBPACKAGE = "triton_kernels"


class _SourceFolderFinder(importlib.abc.MetaPathFinder):
    """Finds one package name in a folder outside its parent package."""

    def __init__(self, name: str, folder: str) -> None:
        self.name = name
        self.folder = folder

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.folder, "__init__.py"),
            submodule_search_locations=[self.folder],
        )


def _map_source_folder() -> None:
    if os.path.isdir(os.path.join(_PACKAGE_DIR, _SUBPACKAGE)):
        return  # installed from a wheel
    folder = os.path.join(_SOURCE_ROOT, _SUBPACKAGE)
    # pyproject.toml beside the folder: this is our source tree, not site-packages
    # holding somebody else's triton_kernels.
    if not (os.path.isfile(os.path.join(folder, "__init__.py"))
            and os.path.isfile(os.path.join(_SOURCE_ROOT, "pyproject.toml"))):
        return
    name = f"{__package__}.{_SUBPACKAGE}"
    if not any(isinstance(f, _SourceFolderFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFolderFinder(name, folder))


_map_source_folder()
