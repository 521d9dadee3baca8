"""The patch of ``fsdp_traceable/_torch_patches/checkpointed_side_effects.py``: Dynamo
allows the side effects of a checkpointed module that holds ``fully_shard``-ed modules,
and of no other checkpoint (see this package's ``__init__``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_traceable import fully_shard


class _Counting(nn.Module):
    """A user's module whose forward changes Python state: a checkpoint of it would
    count twice eagerly (forward and recompute) and once compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["n"] += 1
        return self.lin(x)


def _refused_side_effect(model: nn.Module) -> None:
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Unsafe side effect"):
        torch.compile(model, backend="eager", fullgraph=True)(torch.randn(2, 4))


def test_torch_still_refuses_side_effects_in_a_checkpointed_module() -> None:
    # Unpatched torch (this process has no sharded module inside a checkpoint yet, so
    # the patch marks nothing): what a sharded module's traced forward does (bind its
    # parameters) is refused as this module's counter is.
    _refused_side_effect(nn.Sequential(checkpoint_wrapper(_Counting())))


def test_a_sharded_module_inside_a_checkpoint_wrapper_compiles_and_others_still_refuse(
        fake_mesh) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0] = checkpoint_wrapper(fully_shard(model[0], mesh=fake_mesh))
    fully_shard(model, mesh=fake_mesh)
    torch._dynamo.reset()
    out = torch.compile(model, backend="eager", fullgraph=True)(torch.randn(2, 4))
    assert out.shape == (2, 4)
    # The patch is in place now, and a user's own checkpointed side effect is still
    # refused, as torch refuses it without this package.
    _refused_side_effect(nn.Sequential(checkpoint_wrapper(_Counting())))
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
