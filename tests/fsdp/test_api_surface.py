"""The API table of ``docs/api.md`` is what introspecting FSDP2 and fsdp_traceable gives today."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.fsdp as fsdp2

import fsdp_traceable
from tests.fsdp import test_late_attachment
from tests.fsdp.api_surface import (
    DIFFERENCES,
    LATE_ATTACHMENT,
    MISSING_BECAUSE,
    api_table,
    late_attachment_table,
    rows,
)

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"


def test_api_doc_holds_the_generated_api_table():
    """Regenerate with ``python -m tests.fsdp.api_surface`` when the surface changes."""
    assert api_table() in API_DOC.read_text()


def test_api_doc_holds_the_generated_late_attachment_table():
    """Each row's proof is a case of ``late_attachment_cases`` the test runs, or a file."""
    assert late_attachment_table() in API_DOC.read_text()
    run = {name for name, _, _ in test_late_attachment.CASES}
    for _, status, _, proof in LATE_ATTACHMENT:
        assert status in ("same", "differs")
        assert (ROOT / proof).is_file() if proof.startswith("tests/") else proof in run


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


def test_share_comm_ctx_shares_one_stream_context(fake_mesh):
    import torch.nn as nn

    modules = [fsdp_traceable.fully_shard(nn.Linear(4, 4), mesh=fake_mesh) for _ in range(3)]
    assert modules[0]._fsdp_group.settings.streams is not modules[1]._fsdp_group.settings.streams
    fsdp2.share_comm_ctx(modules)
    assert all(m._fsdp_group.settings.streams is modules[0]._fsdp_group.settings.streams for m in modules)


def test_post_optim_event_is_used_by_the_next_copy_in_only(fake_mesh):
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fsdp_traceable.fully_shard(model[0], mesh=fake_mesh)
    fsdp_traceable.fully_shard(model, mesh=fake_mesh)
    event = torch.Event(device="cpu")
    model.set_post_optim_event(event)
    groups = [model._fsdp_group, model[0]._fsdp_group]
    assert all(g.settings.streams.post_optim_event is event for g in groups)
    with groups[0].settings.streams.copy_in_context():
        pass
    assert groups[0].settings.streams.post_optim_event is None
    assert groups[1].settings.streams.post_optim_event is event
