"""How the package installs: the top-level ``triton_kernels/`` folder becomes
``fsdp_traceable.triton_kernels``, so another package's ``triton_kernels`` (the registry's
``triton-kernels``, Triton's own kernel library) imports beside ours. The compatibility
job installs the registry's ``triton-kernels`` next to ours and imports both."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_package_list_names_every_package_folder():
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "fsdp_traceable").rglob("__init__.py")
    }
    folders.add("fsdp_traceable.triton_kernels")
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == folders
    assert setuptools["package-dir"] == {"fsdp_traceable.triton_kernels": "triton_kernels"}


def test_source_tree_imports_the_kernels_under_the_package():
    import fsdp_traceable.triton_kernels as kernels
    from fsdp_traceable.triton_kernels import fields

    assert Path(kernels.__file__).parent == ROOT / "triton_kernels"
    assert fields.__name__ == "fsdp_traceable.triton_kernels.fields"


def test_wheel_installs_beside_another_triton_kernels(tmp_path):
    """The wheel holds ``fsdp_traceable/triton_kernels/`` and no top-level
    ``triton_kernels``; unpacked next to a stand-in ``triton_kernels`` package, both
    import, each from its own folder (run from ``/``, away from the source tree)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fsdp_traceable/triton_kernels/ops.py" in names
    assert not [n for n in names if n.startswith("triton_kernels/")]

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    (site / "triton_kernels").mkdir()
    (site / "triton_kernels" / "__init__.py").write_text("OTHER = True\n")
    probe = (
        "import triton_kernels, fsdp_traceable.triton_kernels as ours\n"
        "from fsdp_traceable.triton_kernels import fields\n"
        "assert triton_kernels.OTHER and not hasattr(ours, 'OTHER')\n"
        "print(ours.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(site / "fsdp_traceable" / "triton_kernels" / "__init__.py")
