"""torchao's float8 training weights (``Float8Linear`` with
``enable_fsdp_float8_all_gather=True``), whose FSDP2 all-gather hooks send 1 byte per
weight element plus a scale: eager training against FSDP2 on 2 gloo ranks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

import fsdp_traceable
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.feature_cases import assert_bitwise, record_all_gathers

STEPS = 3


def _float8_model() -> nn.Module:
    torch.manual_seed(0)
    # Biases keep each group's bucket mixed-dtype (sent as bytes): gloo has no float8.
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))
    convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local()
    if isinstance(local, WeightWithDynamicFloat8CastTensor):
        local = local._tensor
    return local.detach().clone()


def _train(model: nn.Module, rank: int) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    with record_all_gathers(
        lambda output, input, group: input.numel() * input.element_size()
    ) as gathered_bytes:
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(10 * step + rank)
            inputs = torch.randn(16, 32, generator=generator)
            target = torch.randn(16, 48, generator=generator)
            loss = F.mse_loss(model(inputs), target)
            loss.backward()
            if grads is None:
                grads = [p.grad.to_local().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return {"losses": losses, "grads": grads, "gathered_bytes": gathered_bytes,
            "params": [_local(p) for p in model.parameters()],
            "float8_weights": [isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)
                               for p in model.parameters()]}


def _against_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    base = _float8_model()
    result = {}
    for name, fully_shard in (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        model = copy.deepcopy(base)
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        result[name] = _train(model, rank)
    return result


@pytest.mark.gloo
def test_torchao_float8_weights_train_bitwise_like_fsdp2() -> None:
    for theirs_ours in run_on_local_ranks(_against_fsdp2, 2):
        theirs, ours = theirs_ours["theirs"], theirs_ours["ours"]
        assert ours["float8_weights"] == theirs["float8_weights"] == [True, False, True, False]
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients")
        assert_bitwise(theirs["params"], ours["params"], "local parameters")
        # Every all-gather, both libraries: 1 byte per weight element and 4 per bias
        # element of this rank's shards. The forward gathers each linear once.
        first, second = 32 * 64 // 2 + 4 * 64 // 2, 64 * 48 // 2 + 4 * 48 // 2
        assert ours["gathered_bytes"][:2] == theirs["gathered_bytes"][:2] == [first, second]
        assert set(ours["gathered_bytes"]) == set(theirs["gathered_bytes"]) == {first, second}
        # Backward re-gathers both linears: autograd kept no unsharded float8 weight.
        assert len(ours["gathered_bytes"]) == len(theirs["gathered_bytes"]) == 4 * STEPS
