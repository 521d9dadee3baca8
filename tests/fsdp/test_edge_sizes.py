"""Edge sizes: tiny, one-element and empty parameters; fp16 averaging at 1 to 16 ranks.

Parameters smaller than the world (3 elements, 2 rows, 1 element) leave some ranks
an empty shard: a model made of them trains on 4 gloo ranks bit for bit like torch's
FSDP2, with the same local shard shapes. Zero-size parameters (``(0,)``, ``(0, 8)``,
``(8, 0)``), which FSDP2 itself cannot reduce (``_chunk_cat expects non-empty
tensor``), change nothing: the same model with them trains bit for bit like the one
without, and like the unsharded model within round-off. A root whose parameters all
live in sharded children (an empty group of its own) trains like FSDP2.

fp16 averaging: for every world size 1 to 16, ``foreach_reduce`` on each simulated
rank (the reduce-scatter replaced by an fp16 sum of every rank's input, as a ring
adds them) gives the fp64 mean of the gradients within fp16 round-off, on data whose
plain fp16 sum overflows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._C._distributed_c10d import FakeProcessGroup

import fsdp_traceable
from fsdp_traceable import foreach_reduce, gradient_divide_schedule, make_shard_info
from fsdp_traceable.collectives import comm
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.feature_cases import (
    assert_bitwise,
    case_results,
    run_cases,
    seeded_transformer,
)
from tests.fsdp.parity_utils import full_params, make_optimizer, shard_copies

DIM, STEPS = 8, 3
FP16 = torch.float16


class EdgeBlock(nn.Module):
    """A block whose parameters are all smaller than 4 ranks but one; ``empties`` adds
    zero-size ones (made without drawing random numbers, so both variants of a seed
    hold the same other parameters)."""

    def __init__(self, empties: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.tiny = nn.Parameter(torch.randn(3))
        self.rows = nn.Parameter(torch.randn(2, DIM))
        self.one = nn.Parameter(torch.randn(1))
        self.one_2d = nn.Parameter(torch.randn(1, 1))
        self.empties = empties
        if empties:
            self.empty = nn.Parameter(torch.zeros(0))
            self.empty_rows = nn.Parameter(torch.zeros(0, DIM))
            self.empty_cols = nn.Parameter(torch.zeros(DIM, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + F.pad(self.tiny, (0, DIM - 3)) + self.rows.sum(0)
        h = h * self.one + self.one_2d[0]
        if self.empties:
            h = h + self.empty.sum() + self.empty_rows.sum(0) + (x @ self.empty_cols).sum(-1, True)
        return torch.tanh(h)


class EdgeModel(nn.Module):
    def __init__(self, empties: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EdgeBlock(empties) for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.bias = nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1) + self.bias

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x), y)


def shard_blocks_then_root(model: nn.Module, fully_shard_fn: Callable, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard_fn(block, **kwargs)
    return fully_shard_fn(model, **kwargs)


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, DIM, generator=generator), torch.randn(4, generator=generator)


def _train(model: nn.Module, ranks: list[int]) -> dict:
    """AdamW steps on the data of ``ranks`` (one rank: sharded; all: the reference)."""
    optimizer = make_optimizer("adamw", model.parameters())
    losses, grads = [], None
    for step in range(STEPS):
        loss = torch.stack([model.loss(*_data(step, r)) for r in ranks]).mean()
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = [p.grad if p.grad is None else
                     p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                     for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "params": _full_params(model)}


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    """Full parameters, an empty one as an empty tensor of its shape: ``full_tensor``
    fails on an (8, 0) parameter at 4 ranks, under torch's FSDP2 too (the DTensor
    expects the local shape (2, 0) where FSDP2's layout has (0, 0))."""
    return [torch.empty(p.shape) if p.numel() == 0 else full_params(nn.ParameterList([p]))[0]
            for p in model.parameters()]


def edge_model_training(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = EdgeModel(empties=False)
    torch.manual_seed(0)
    base_with_empties = EdgeModel(empties=True)
    theirs, ours = shard_copies(base, shard_fn=shard_blocks_then_root)
    ours_with_empties = shard_blocks_then_root(
        copy.deepcopy(base_with_empties), fsdp_traceable.fully_shard)
    return {
        "names": [n for n, _ in base.named_parameters()],
        "names_with_empties": [n for n, _ in base_with_empties.named_parameters()],
        "local_shapes": [(tuple(a.to_local().shape), tuple(b.to_local().shape))
                         for a, b in zip(theirs.parameters(), ours.parameters())],
        "local_shapes_with_empties": [tuple(p.to_local().shape)
                                      for p in ours_with_empties.parameters()],
        "theirs": _train(theirs, [rank]),
        "ours": _train(ours, [rank]),
        "ours_with_empties": _train(ours_with_empties, [rank]),
        "reference_with_empties": _train(base_with_empties, list(range(world_size))),
    }


def empty_root_group(rank: int, world_size: int) -> dict:
    """A root with no parameters of its own: its blocks' and the model's training
    match FSDP2, with the root sharded as well."""
    base = nn.Sequential(*seeded_transformer().layers)  # blocks only: the root owns none
    theirs, ours = shard_copies(base, shard_fn=_shard_sequential)
    x = torch.randn(2, 16, base[0].attention.wq.in_features,
                    generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        optimizer = make_optimizer("adamw", model.parameters())
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results[name] = full_params(model)
    return results


def _shard_sequential(model: nn.Sequential, fully_shard_fn: Callable, **kwargs) -> nn.Module:
    for block in model:
        fully_shard_fn(block, **kwargs)
    return fully_shard_fn(model, **kwargs)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    cases = [("edge", edge_model_training, ()), ("empty_root", empty_root_group, ())]
    return run_on_local_ranks(run_cases, 4, cases, timeout_s=60)



@pytest.mark.gloo
def test_parameters_smaller_than_the_world_train_like_fsdp2(four_ranks):
    for rank, result in enumerate(case_results(four_ranks, "edge")):
        for name, (theirs, ours) in zip(result["names"], result["local_shapes"]):
            assert ours == theirs, f"rank {rank} {name}: local shard {ours} vs FSDP2 {theirs}"
        assert result["ours"]["losses"] == result["theirs"]["losses"]
        assert_bitwise(result["theirs"]["grads"], result["ours"]["grads"], "first gradients")
        assert_bitwise(result["theirs"]["params"], result["ours"]["params"], "parameters")
    shapes = dict(zip(four_ranks[3]["edge"]["names"], four_ranks[3]["edge"]["local_shapes"]))
    # The last rank holds nothing of the parameters smaller than the world.
    assert shapes["blocks.0.tiny"] == ((0,), (0,))
    assert shapes["blocks.0.rows"] == ((0, DIM), (0, DIM))
    assert shapes["blocks.0.one"] == ((0,), (0,))


@pytest.mark.gloo
def test_zero_size_parameters_change_nothing_and_match_unsharded(four_ranks):
    for result in case_results(four_ranks, "edge"):
        names = result["names_with_empties"]
        shapes = dict(zip(names, result["local_shapes_with_empties"]))
        assert shapes["blocks.1.empty_cols"] == (0, 0) and shapes["blocks.1.empty"] == (0,)
        with_empties = result["ours_with_empties"]
        kept = [i for i, name in enumerate(names) if "empty" not in name]
        assert with_empties["losses"] == result["ours"]["losses"]
        assert_bitwise(result["ours"]["params"], [with_empties["params"][i] for i in kept],
                       "parameters beside the empty ones")
        for i, name in enumerate(names):  # an empty parameter gets no (empty) gradient
            assert (with_empties["grads"][i] is None) == ("empty" in name), name
        for ours, reference in zip(with_empties["params"],
                                   result["reference_with_empties"]["params"]):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.gloo
def test_root_without_own_parameters_trains_like_fsdp2(four_ranks):
    for result in case_results(four_ranks, "empty_root"):
        assert_bitwise(result["theirs"], result["ours"], "parameters")


# -- fp16 averaging at 1 to 16 ranks, single process ------------------------------


def _fp16_grads(world_size: int, rank: int) -> list[torch.Tensor]:
    """Gradients near ``v`` where ``world * v`` overflows fp16 but ``world * v / pre`` fits."""
    pre = gradient_divide_schedule(world_size, 1, FP16).predivide_factor
    value = 0.9 * 65504.0 / world_size * (1 + pre) / 2
    generator = torch.Generator().manual_seed(rank)
    shapes = [(2 * world_size + 1, 3), (5,)]  # uneven dim 0: padding too
    return [(value * (1 + 0.01 * (2 * torch.rand(s, generator=generator) - 1))).to(FP16)
            for s in shapes]


def _simulated_foreach_reduce(world_size: int, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every rank's ``foreach_reduce`` output, the reduce-scatter summing in fp16."""
    grads = [_fp16_grads(world_size, r) for r in range(world_size)]
    infos = [[make_shard_info(g.shape, world_size, r, orig_dtype=FP16) for g in grads[r]]
             for r in range(world_size)]
    inputs: list[torch.Tensor] = []

    def capture(flat: torch.Tensor, op: str, group: object, custom=None) -> comm.PendingTensor:
        inputs.append(flat.clone())
        return comm.PendingTensor(flat.new_zeros(flat.numel() // world_size), None)

    monkeypatch.setattr(comm, "start_reduce_scatter", capture)
    for r in range(world_size):
        foreach_reduce(grads[r], infos[r], FakeProcessGroup._create_internal(r, world_size))
    ops = []

    def ring_sum(flat: torch.Tensor, op: str, group: object, custom=None) -> comm.PendingTensor:
        ops.append(op)
        total = inputs[0]
        for other in inputs[1:]:
            total = total + other  # fp16 add, rounded at every step
        return comm.PendingTensor(total.chunk(world_size)[group.rank()].clone(), None)

    monkeypatch.setattr(comm, "start_reduce_scatter", ring_sum)
    outputs = [foreach_reduce(grads[r], infos[r],
                              FakeProcessGroup._create_internal(r, world_size)).sharded_grads
               for r in range(world_size)]
    assert set(ops) <= {"sum"}
    return grads, outputs


@pytest.mark.parametrize("world_size", range(1, 17))
def test_fp16_average_matches_fp64_mean_without_overflow(world_size, monkeypatch):
    grads, outputs = _simulated_foreach_reduce(world_size, monkeypatch)
    if world_size > 1:  # the data are sharp: the plain fp16 sum overflows
        plain = grads[0][0]
        for rank_grads in grads[1:]:
            plain = plain + rank_grads[0]
        assert torch.isinf(plain).any()
    rtol = (world_size + 3) * 2.0**-11
    for i in range(len(grads[0])):
        mean = torch.stack([g[i].double() for g in grads]).mean(0)
        gathered = torch.cat([outputs[r][i] for r in range(world_size)])
        assert gathered.dtype == FP16 and torch.isfinite(gathered).all()
        torch.testing.assert_close(gathered.double(), mean, rtol=rtol, atol=0)
