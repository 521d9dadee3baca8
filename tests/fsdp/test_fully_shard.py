"""fully_shard against torch's FSDP2 and an unsharded model, on real gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.parity_utils import (
    SMALL,
    all_ranks_mean,
    backward_context,
    batch,
    full_params,
    loss_fn,
    make_models,
    make_optimizer,
    reference_step,
)

STEPS = 5
# Compiled runs train one block: Inductor's code for a block is the same for every block
# of a whole-model graph, and each more block costs seconds of compile on 2 ranks.
ONE_BLOCK = dataclasses.replace(SMALL, n_layers=1)
pytestmark = pytest.mark.gloo


def _train_against_fsdp2(rank: int, world_size: int, mode: str, optim: str, mp: str | None):
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mp == "bf16" else MixedPrecisionPolicy()
    )
    config = ONE_BLOCK if mode.startswith("compile") else SMALL
    base, theirs, ours = make_models(config, mp_policy=mp_policy)
    opt_base = make_optimizer(optim, base.parameters())
    opt_theirs = make_optimizer(optim, theirs.parameters())
    opt_ours = make_optimizer(optim, ours.parameters())
    ours_loss = loss_fn(ours, mode)
    backward_ctx = backward_context(mode)
    rows = []
    for step in range(STEPS):
        data = batch(step, rank, world_size)
        loss_theirs = theirs.loss(*data)
        loss_theirs.backward()
        opt_theirs.step()
        opt_theirs.zero_grad()
        loss_ours = ours_loss(*data)
        with backward_ctx():
            loss_ours.backward()
        opt_ours.step()
        opt_ours.zero_grad()
        loss_base = reference_step(base, opt_base, step, world_size)
        rows.append((loss_theirs.item(), loss_ours.item(),
                     all_ranks_mean(loss_theirs.item()), all_ranks_mean(loss_ours.item()),
                     loss_base))
    return rows, full_params(base), full_params(theirs), full_params(ours)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# Compiled: Inductor with compiled autograd here; whole-model Inductor compile without it
# is the README quickstart's test (against the unsharded model), AOTAutograd's eager
# backend is bf16's below and tests/fsdp/test_compiled_parity.py's.
@pytest.mark.parametrize(
    "world_size,mode,optim",
    [(2, "eager", "adamw"), (4, "eager", "adamw"), (2, "compile-ca", "sgd")],
)
def test_fp32_training_matches_fsdp2_and_unsharded(world_size: int, mode: str, optim: str):
    for rows, base, theirs, ours in run_on_local_ranks(_train_against_fsdp2, world_size, mode, optim, None):
        for loss_theirs, loss_ours, mean_theirs, mean_ours, loss_base in rows:
            if mode == "eager":
                assert loss_ours == loss_theirs
            else:
                assert abs(loss_ours - loss_theirs) <= 1e-5
            assert abs(mean_ours - loss_base) <= 1e-5
        if mode == "eager":
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        else:
            assert _max_diff(ours, theirs) <= 1e-5
        assert _max_diff(ours, base) <= 1e-5


@pytest.mark.parametrize("mode", ["eager", "compile-ca-aot-eager"])
def test_bf16_mixed_precision_within_fsdp2_error(mode: str):
    for rows, base, theirs, ours in run_on_local_ranks(_train_against_fsdp2, 2, mode, "adamw", "bf16"):
        fsdp2_error = _max_diff(theirs, base)
        assert fsdp2_error > 0  # bf16 compute really ran
        if mode == "eager":
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        assert _max_diff(ours, base) <= 1.5 * fsdp2_error
        for loss_theirs, loss_ours, _, mean_ours, loss_base in rows:
            assert abs(mean_ours - loss_base) <= 1.5 * max(abs(loss_theirs - loss_base), 2e-2)
