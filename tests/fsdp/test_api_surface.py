"""The README's API table is what introspecting FSDP2 and fsdp_traceable gives today."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.fsdp as fsdp2

import fsdp_traceable
from tests.fsdp.api_surface import DIFFERENCES, MISSING_BECAUSE, api_table, rows

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_holds_the_generated_api_table():
    """Regenerate with ``python -m tests.fsdp.api_surface`` when the surface changes."""
    assert api_table() in README.read_text()


def test_every_fsdp_module_method_of_torch_is_listed():
    listed = {name for name, _, _ in rows()}
    methods = {f"`FSDPModule.{n}`" for n, v in vars(fsdp2.FSDPModule).items()
               if not n.startswith("_") and callable(v)}
    assert methods <= listed


def test_notes_name_real_methods_and_missing_ones_raise():
    names = set(vars(fsdp2.FSDPModule)) | set(fsdp2.__all__)
    assert set(DIFFERENCES) <= names and set(MISSING_BECAUSE) <= names
    for name, status, _ in rows():
        if status == "missing" and name.startswith("`FSDPModule."):
            method = getattr(fsdp_traceable.FSDPModule, name[len("`FSDPModule."):-1])
            try:
                method(object.__new__(fsdp_traceable.FSDPModule))
            except NotImplementedError:
                continue
            raise AssertionError(f"{name} is listed missing but did not raise")


def test_share_comm_ctx_raises_clearly_on_our_modules(fake_mesh):
    import pytest
    import torch.nn as nn

    modules = [fsdp_traceable.fully_shard(nn.Linear(4, 4), mesh=fake_mesh) for _ in range(2)]
    with pytest.raises(NotImplementedError, match="share_comm_ctx is not supported"):
        fsdp2.share_comm_ctx(modules)
