"""Frozen parameters of dtypes FSDP2 gathers but never reduces: an integer
``nn.Parameter`` (``requires_grad=False``, e.g. a lookup table) and a float8 weight.
Sharded, all-gathered as they are (the integer one never cast by the mixed-precision
policy; the float8 one cast as FSDP2 casts every floating parameter), never reduced:
2 gloo ranks train bit for bit like torch's FSDP2, trainable and frozen parameters
alike, with and without a bf16 policy, eager and compiled (``aot_eager``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_traceable
from fsdp_traceable.fsdp.sharded_params import shard_info_in_dtype
from fsdp_traceable.testing import fake_process_group
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.feature_cases import assert_bitwise, case_results, run_cases
from tests.fsdp.parity_utils import full_params, make_optimizer, shard_copies

DIM, STEPS = 8, 3
FLOAT8 = getattr(torch, "float8_e4m3fn", None)


class FrozenDtypes(nn.Module):
    """A trainable linear layer beside a frozen int64 index table and a frozen float8
    weight, both read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.order = nn.Parameter(torch.randperm(DIM), requires_grad=False)
        self.scale = nn.Parameter((torch.randn(DIM, DIM) / 4).to(FLOAT8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.scale.to(x.dtype)
        return self.linear(x).index_select(-1, self.order)


def _shard(model: nn.Module, fully_shard_fn: Any, **kwargs: Any) -> nn.Module:
    return fully_shard_fn(model, **kwargs)


def frozen_dtypes_training(rank: int, world_size: int, bf16: bool, compiled: bool) -> dict:
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    try:  # shards FSDP2's copy first
        theirs, ours = shard_copies(FrozenDtypes(), shard_fn=_shard, mp_policy=policy)
    except RuntimeError as err:  # torch 2.11's FSDP2: requires_grad_ on the integer shard
        return {"fsdp2_rejects": str(err)}
    results: dict[str, Any] = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        optimizer = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
        forward = (torch.compile(model, backend="aot_eager", fullgraph=True)
                   if compiled and name == "ours" else model)
        losses = []
        for step in range(STEPS):
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = forward(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        results[name] = {
            "losses": losses,
            # gloo gathers no float8: the frozen parameters compare shard by shard.
            "params": full_params(nn.ParameterList(p for p in model.parameters()
                                                   if p.requires_grad)),
            "frozen_shards": [p.to_local().view(torch.uint8) if p.dtype == FLOAT8
                              else p.to_local().clone()
                              for p in model.parameters() if not p.requires_grad],
            "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
            "dtypes": [p.dtype for p in model.parameters()],
        }
    return results


CASES = [(f"{'bf16' if bf16 else 'fp32'}-{'compiled' if compiled else 'eager'}",
          frozen_dtypes_training, (bf16, compiled))
         for bf16 in (False, True) for compiled in (False, True)]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_local_ranks(run_cases, 2, CASES, timeout_s=300)


@pytest.mark.gloo
@pytest.mark.skipif(FLOAT8 is None, reason="needs torch.float8_e4m3fn")
@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_frozen_integer_and_float8_parameters_train_like_fsdp2(two_ranks, case):
    for result in case_results(two_ranks, case):
        if "fsdp2_rejects" in result:
            pytest.skip(f"torch's FSDP2 cannot shard the model here: {result['fsdp2_rejects']}")
        theirs, ours = result["theirs"], result["ours"]
        # The module's own parameters first, then its linear layer's.
        assert ours["dtypes"] == theirs["dtypes"] == [torch.int64, FLOAT8, torch.float32,
                                                      torch.float32]
        assert ours["local_shapes"] == theirs["local_shapes"]
        assert_bitwise(theirs["losses"], ours["losses"], f"{case} losses")
        assert_bitwise(theirs["params"], ours["params"], f"{case} parameters")
        assert_bitwise(theirs["frozen_shards"], ours["frozen_shards"], f"{case} frozen shards")


def test_a_trainable_parameter_of_a_dtype_no_backend_reduces_is_named() -> None:
    with pytest.raises(TypeError, match="parameter 'scale': requires_grad=True with dtype "
                                        "torch.float8_e4m3fn"):
        shard_info_in_dtype("scale", torch.Size([4, 4]), 2, 0, FLOAT8, True,
                            MixedPrecisionPolicy(), shard_dim=0, offload_to_cpu=False)


def test_module_to_a_dtype_no_backend_reduces_names_the_parameter() -> None:
    with fake_process_group(2):
        model = fsdp_traceable.fully_shard(nn.Linear(4, 4))
        with pytest.raises(TypeError, match="parameter 'weight': requires_grad=True with "
                                            "dtype torch.float8_e4m3fn"):
            model.to(FLOAT8)
            model(torch.randn(2, 4).to(FLOAT8))
