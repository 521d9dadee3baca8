"""An eager train step shows each of its phases in the profiler as
``fsdp_traceable::<phase> (<module>)`` (``fsdp_traceable/profiler_labels.py``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_traceable import fully_shard
from fsdp_traceable.profiler_labels import label

PHASES = (
    "pre_forward", "all_gather", "all_gather_copy_out", "post_forward", "reshard",
    "pre_backward", "post_backward", "reduce_scatter", "reduce_scatter_wait", "all_reduce",
    "root_post_backward",
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.layers(x)))


def _phases_seen(keys: set[str]) -> dict[str, set[str]]:
    """Per phase, the modules its labels named ("" for none)."""
    seen: dict[str, set[str]] = {}
    for phase in PHASES:
        for key in keys:
            if key == label(phase):
                seen.setdefault(phase, set()).add("")
            elif key.startswith(label(phase) + " ("):
                seen.setdefault(phase, set()).add(key[len(label(phase)) + 2 : -1])
    return seen


def test_every_eager_phase_is_labelled(one_gloo_rank) -> None:
    torch.manual_seed(0)
    model = Net()
    # HSDP on a 1 x 1 mesh, so the reduction has its all-reduce phase too.
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # a step before: the profiled one is a steady one
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    seen = _phases_seen({event.key for event in prof.key_averages()})
    assert sorted(seen) == sorted(PHASES)
    assert seen["all_gather"] == {"", "layers.0", "layers.1"}  # the root's group is ""
    assert seen["post_backward"] == {"", "layers.0", "layers.1"}


def test_no_label_without_a_profiler(one_gloo_rank, monkeypatch) -> None:
    entered = []
    monkeypatch.setattr(torch.profiler, "record_function",
                        lambda name: entered.append(name))
    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    model(torch.randn(4, 8)).sum().backward()
    assert entered == []
