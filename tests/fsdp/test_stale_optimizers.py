"""An optimizer built before ``fully_shard`` raises at its first step, naming the fix;
one built after, and one of an unrelated model, step as usual (single process, fake
group of 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_traceable import fully_shard
from fsdp_traceable.whole_step.traced_optimizer import TracedOptimizer


def test_optimizer_built_before_fully_shard_raises_at_its_first_step(fake_mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    unrelated = nn.Linear(4, 4)
    stale = torch.optim.AdamW(model.parameters())
    fully_shard(model[0], mesh=fake_mesh)
    fully_shard(model, mesh=fake_mesh)
    fresh = torch.optim.AdamW(model.parameters())
    other = torch.optim.SGD(unrelated.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    unrelated(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"AdamW holds 4 parameter\(s\) that fully_shard "
                       r"replaced.*Build the optimizer after fully_shard"):
        stale.step()
    before = unrelated.weight.detach().clone()
    for optimizer in (fresh, other, fresh):
        optimizer.step()
    assert not torch.equal(unrelated.weight, before)


def test_whole_step_optimizer_is_checked_too(fake_mesh):
    """``compile_step(optimizer=...)`` runs the update without ``step()``: its traced
    optimizer makes the same check, and does not take the check for a user's hook."""
    model = nn.Linear(4, 4)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, mesh=fake_mesh)
    with pytest.raises(RuntimeError, match="built before fully_shard"):
        TracedOptimizer(stale)
    TracedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
