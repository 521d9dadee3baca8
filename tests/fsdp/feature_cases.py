"""Rank-side bodies of the fully_shard feature tests: each trains torch's FSDP2 and ours.

Every case takes ``(rank, world_size)``, builds one model, shards a copy with each
library, drives both through the same calls on the same data, and returns plain
results (losses, full parameters, counters) for the parent test to compare.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as FSDP2Module
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import fsdp_traceable
from fsdp_traceable.collectives import comm
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)
from tests.fsdp.parity_utils import (
    SMALL,
    batch,
    full_params,
    make_optimizer,
    shard_copies,
)

N_GROUPS = SMALL.n_layers + 1  # one per block, plus the root
BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

MicrobatchHook = Callable[[nn.Module, int, int], None]


@contextlib.contextmanager
def count_calls(module: Any, name: str) -> Iterator[list[int]]:
    """Counts calls of ``module.name`` while the context is open.

    Args:
        module: the module holding the function, looked up by callers at call time
            (e.g. ``torch.distributed``).
        name: the attribute to wrap.

    Returns:
        A one-element list; ``counter[0]`` is the number of calls so far.
    """
    original = getattr(module, name)
    counter = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield counter
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def count_all_gathers() -> Iterator[list[int]]:
    """Counts the eager c10d all-gathers issued by either library, under both names
    (``all_gather_single`` where torch has it, ``all_gather_into_tensor``).

    Returns:
        A one-element list; ``counter[0]`` is the number of all-gathers so far.
    """
    total = [0]
    with count_calls(dist, "all_gather_into_tensor") as ours, \
            count_calls(dist, "all_gather_single") as theirs:
        try:
            yield total
        finally:
            total[0] = ours[0] + theirs[0]


@contextlib.contextmanager
def record_c10d_calls(names: tuple[str, ...], record: Callable[..., Any]) -> Iterator[list]:
    """Records ``record(output, input, args, kwargs)`` for every call of the c10d
    functions ``names`` (those this torch has) either library issues (the outermost call
    only), in call order.

    Returns:
        The list the records are appended to.
    """
    records: list = []
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    depth = [0]

    def recording(original: Callable) -> Callable:
        def call(output, input, *args, **kwargs):
            if depth[0] == 0:
                records.append(record(output, input, args, kwargs))
            depth[0] += 1
            try:
                return original(output, input, *args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name, original in originals.items():
        setattr(dist, name, recording(original))
    try:
        yield records
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def record_all_gathers(record: Callable[[torch.Tensor, torch.Tensor, Any], Any]
                       ) -> contextlib.AbstractContextManager[list]:
    """Records ``record(output, input, group)`` for every eager c10d flat all-gather
    either library issues (under both names; the outermost call only), in call order."""
    return record_c10d_calls(
        ("all_gather_single", "all_gather_into_tensor"),
        lambda output, input, args, kwargs: record(
            output, input, kwargs.get("group", args[0] if args else None)))


def case_results(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Case ``name``'s result on every rank; fails the test with a rank's traceback if
    the case raised there."""
    for rank, result in enumerate(results):
        if "error" in result[name]:
            pytest.fail(f"case {name!r} raised on rank {rank}:\n{result[name]['error']}")
    return [r[name] for r in results]


def count_reduce_scatters() -> contextlib.AbstractContextManager[list[int]]:
    """Counts the reduce-scatter collectives our eager path issues (``comm.REDUCE_SCATTER_C10D``)."""
    return count_calls(dist, comm.REDUCE_SCATTER_C10D)


def seeded_transformer(config: TransformerConfig = SMALL, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every module either library's ``fully_shard`` was applied to."""
    return [m for m in model.modules()
            if isinstance(m, (FSDP2Module, fsdp_traceable.FSDPModule))]


def train(
    model: nn.Module,
    rank: int,
    world_size: int,
    *,
    steps: int = 2,
    microbatches: int = 1,
    before_microbatch: MicrobatchHook | None = None,
    after_backward: MicrobatchHook | None = None,
) -> dict[str, Any]:
    """AdamW training, one optimizer step per ``microbatches`` backward calls.

    Returns:
        ``losses`` (per microbatch), ``grads`` (full gradients before the first step,
        ``None`` where a parameter has none) and ``params`` (full, at the end).
    """
    optimizer = make_optimizer("adamw", model.parameters())
    losses, first_grads = [], None
    for step in range(steps):
        for micro in range(microbatches):
            if before_microbatch is not None:
                before_microbatch(model, micro, microbatches)
            loss = model.loss(*batch(step * microbatches + micro, rank, world_size))
            loss.backward()
            if after_backward is not None:
                after_backward(model, micro, microbatches)
            losses.append(loss.item())
        if first_grads is None:
            first_grads = [None if p.grad is None else p.grad.full_tensor()
                           for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": first_grads, "params": full_params(model)}


def train_both(base: nn.Module, rank: int, world_size: int, shard_kwargs: dict | None = None,
               **train_kwargs: Any) -> dict[str, Any]:
    """Shards a copy of ``base`` with each library and trains both the same way.

    Args:
        base: the unsharded model (left untouched).
        rank, world_size: this rank and the world size (they choose the data).
        shard_kwargs: for :func:`~tests.parity_utils.shard_copies`.
        train_kwargs: for :func:`train`.

    Returns:
        ``{"theirs": ..., "ours": ...}``, each what :func:`train` returns.
    """
    theirs, ours = shard_copies(base, **(shard_kwargs or {}))
    return {"theirs": train(theirs, rank, world_size, **train_kwargs),
            "ours": train(ours, rank, world_size, **train_kwargs)}


def run_cases(rank: int, world_size: int, cases: list[tuple[str, Callable, tuple]]) -> dict:
    """Runs each case on this rank; a failing case records its traceback, the rest run.

    Args:
        rank, world_size: passed first to every case.
        cases: ``(name, fn, args)``; ``fn(rank, world_size, *args)`` must be module-level.

    Returns:
        ``{name: fn's result}``, or ``{name: {"error": traceback}}`` where it raised.
    """
    results = {}
    for name, fn, args in cases:
        try:
            results[name] = fn(rank, world_size, *args)
        except Exception:  # noqa: BLE001  (reported per case by the parent test)
            results[name] = {"error": traceback.format_exc()}
    return results


def assert_bitwise(
    theirs: list[torch.Tensor | None], ours: list[torch.Tensor | None], what: str
) -> None:
    """Asserts two lists of tensors (or ``None``s) are equal element by element, bit for bit."""
    assert len(theirs) == len(ours), f"{what}: {len(theirs)} vs {len(ours)} tensors"
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}[{i}]: one is None"
            continue
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        assert torch.equal(a, b), f"{what}[{i}] differs, max |diff| {diff}"


def assert_same_training(theirs: dict[str, Any], ours: dict[str, Any]) -> None:
    """Asserts two :func:`train` results have equal losses, first gradients and parameters."""
    assert ours["losses"] == theirs["losses"]
    assert_bitwise(theirs["grads"], ours["grads"], "first-step gradients")
    assert_bitwise(theirs["params"], ours["params"], "parameters")


# -- cases ------------------------------------------------------------------------


def grad_accumulation(rank: int, world_size: int) -> dict[str, Any]:
    """3 microbatches a step, every group (the root's embeddings too) resharding after
    forward; counts each library's all-gathers."""
    theirs, ours = shard_copies(seeded_transformer(), reshard_after_forward=True)
    result: dict[str, Any] = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        with count_all_gathers() as gathers:
            result[name] = train(model, rank, world_size, microbatches=3)
        result[f"{name}_all_gathers"] = gathers[0]
    return result


NO_SYNC_POLICIES = {
    "fp32": None,
    "bf16": BF16_POLICY,
    # fp32 gradients summed into a bf16 accumulator: FSDP2 rounds each sum (2.15: each
    # gradient first), see [Note: wider gradient dtypes].
    "bf16_reduce": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
}


def no_sync_accumulation(rank: int, world_size: int, precision: str) -> dict[str, Any]:
    """Gradient sync off for all but the last of 3 microbatches (FSDP2's recipe), with
    the policy ``NO_SYNC_POLICIES[precision]``."""
    policy = NO_SYNC_POLICIES[precision]
    shard_kwargs = {"mp_policy": policy} if policy is not None else {}
    theirs, ours = shard_copies(seeded_transformer(), **shard_kwargs)
    grads_none_before_sync: list[bool] = []

    def hook(model: nn.Module, micro: int, microbatches: int) -> None:
        if micro == microbatches - 1 and model is ours:
            grads_none_before_sync.append(all(p.grad is None for p in model.parameters()))
        model.set_requires_gradient_sync(micro == microbatches - 1)

    result = {"theirs": train(theirs, rank, world_size, microbatches=3, before_microbatch=hook)}
    with count_reduce_scatters() as reduce_scatters:
        result["ours"] = train(ours, rank, world_size, microbatches=3, before_microbatch=hook)
    result["reduce_scatters"] = reduce_scatters[0]
    result["grads_none_before_sync"] = grads_none_before_sync
    return result


def hsdp(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    theirs, ours = shard_copies(seeded_transformer(), mesh=mesh)
    placements = [(tuple(a.placements), tuple(b.placements), a.to_local().shape, b.to_local().shape)
                  for a, b in zip(theirs.parameters(), ours.parameters())]
    return {"theirs": train(theirs, rank, world_size, steps=3),
            "ours": train(ours, rank, world_size, steps=3), "placements": placements}


def unused_params(rank: int, world_size: int) -> dict[str, Any]:
    """Parameters forward never uses (one in the root group, one in a block): their
    .grad stays None, so AdamW's weight decay skips them as it does under FSDP2."""
    base = seeded_transformer()
    base.unused_head = nn.Linear(base.config.dim, 4)
    base.layers[0].unused_scale = nn.Parameter(torch.ones(base.config.dim))
    result = train_both(base, rank, world_size)
    result["unused_mask"] = ["unused" in n for n, _ in base.named_parameters()]
    return result


FROZEN = ("tok_embeddings.weight", "layers.0.ffn_norm.weight")


def frozen_params(rank: int, world_size: int) -> dict[str, Any]:
    """Frozen: the embedding (root group), one norm (mixed block) and all of block 1."""
    base = seeded_transformer()
    frozen = set(FROZEN) | {f"layers.1.{n}" for n, _ in base.layers[1].named_parameters()}
    for name, param in base.named_parameters():
        param.requires_grad_(name not in frozen)
    theirs, ours = shard_copies(base)
    result = {"theirs": train(theirs, rank, world_size)}
    with count_all_gathers() as gathers:
        result["ours"] = train(ours, rank, world_size)
    result["all_gathers"] = gathers[0]
    result["frozen_mask"] = [n in frozen for n, _ in base.named_parameters()]
    result["initial"] = full_params(base)
    return result


class BufferedTransformer(Transformer):
    """A transformer with buffers used in forward.

    A non-persistent sinusoidal position table replaces the position embedding; a
    running mean of the final hidden state (updated in training forward, like
    BatchNorm's) is subtracted before the output layer; an integer counter counts
    the updates.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        del self.pos_embeddings
        position = torch.arange(config.max_seq_len, dtype=torch.float32)[:, None]
        freqs = torch.exp(torch.arange(0, config.dim, 2) * (-math.log(10000.0) / config.dim))
        table = torch.cat([torch.sin(position * freqs), torch.cos(position * freqs)], dim=1)
        self.register_buffer("position_table", table, persistent=False)
        self.register_buffer("running_mean", torch.zeros(config.dim))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.position_table[: tokens.size(1)]
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
                self.num_updates += 1
        return self.output(h - self.running_mean)


def buffers(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = BufferedTransformer(SMALL)
    theirs, ours = shard_copies(base)
    names = {"theirs": [n for n, _ in theirs.named_buffers()],
             "ours": [n for n, _ in ours.named_buffers()]}
    table_after_sharding = ours.position_table.clone()
    result = {"theirs": train(theirs, rank, world_size, steps=3),
              "ours": train(ours, rank, world_size, steps=3)}
    result.update(
        names=names,
        state_dict_keys={"theirs": list(theirs.state_dict()), "ours": list(ours.state_dict())},
        initial_table=base.position_table,
        table_after_sharding=table_after_sharding,
        buffer_types=[type(b) for b in ours.buffers()],
        final_buffers={"theirs": [b.clone() for b in theirs.buffers()],
                       "ours": [b.clone() for b in ours.buffers()]},
    )
    return result


def reshard_modes(rank: int, world_size: int) -> dict[str, Any]:
    """reshard_after_forward None (the default), True and False on every call, root
    included, counting each library's all-gathers per step."""
    result: dict[str, Any] = {}
    for reshard in (None, True, False):
        for name, fully_shard_fn in (("theirs", fsdp2_fully_shard),
                                     ("ours", fsdp_traceable.fully_shard)):
            model = shard_transformer(seeded_transformer(), fully_shard_fn,
                                      reshard_after_forward=reshard)
            with count_all_gathers() as gathers:
                result[f"{name}_reshard_{reshard}"] = train(model, rank, world_size)
            result[f"{name}_all_gathers_reshard_{reshard}"] = gathers[0]
    return result


def _explicit_unshard_step(model: nn.Module, rank: int, world_size: int, optimizer) -> int:
    """One step with every group unsharded up front; returns our all-gathers inside it."""
    for module in fsdp_modules(model):
        module.unshard()
    with count_all_gathers() as gathers:
        model.loss(*batch(10, rank, world_size)).backward()
    for module in fsdp_modules(model):
        module.reshard()
    optimizer.step()
    optimizer.zero_grad()
    return gathers[0]


def _kept_after_backward_step(model: nn.Module, rank: int, world_size: int, optimizer) -> list[int]:
    """Two microbatches: the first keeps its parameters unsharded after backward."""
    counts = []
    for micro, last in enumerate((False, True)):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        with count_all_gathers() as gathers:
            model.loss(*batch(20 + micro, rank, world_size)).backward()
        counts.append(gathers[0])
    optimizer.step()
    optimizer.zero_grad()
    return counts


def unshard_and_reshard_after_backward(rank: int, world_size: int) -> dict[str, Any]:
    """``unshard()``/``reshard()`` and ``set_reshard_after_backward(False)``, then normal steps."""
    theirs, ours = shard_copies(seeded_transformer())
    result: dict[str, Any] = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        optimizer = make_optimizer("adamw", model.parameters())
        model.loss(*batch(0, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        after_unshard = _explicit_unshard_step(model, rank, world_size, optimizer)
        kept = _kept_after_backward_step(model, rank, world_size, optimizer)
        model.loss(*batch(30, rank, world_size)).backward()
        optimizer.step()
        result[name] = {"params": full_params(model), "all_gathers_after_unshard": after_unshard,
                        "all_gathers_kept_after_backward": kept}
    return result


def tied_transformer() -> Transformer:
    model = seeded_transformer()
    model.output.weight = model.tok_embeddings.weight
    return model


def tied_in_one_group(rank: int, world_size: int) -> dict[str, Any]:
    theirs, ours = shard_copies(tied_transformer())
    tied = {name: m.output.weight is m.tok_embeddings.weight
            for name, m in (("theirs", theirs), ("ours", ours))}
    result = {"theirs": train(theirs, rank, world_size), "ours": train(ours, rank, world_size)}
    result["tied"] = tied
    return result


def tied_across_groups(rank: int, world_size: int) -> dict[str, Any]:
    """The output layer (tied to the embedding) sharded on its own, then the root (a
    parent of the embedding) or the embedding itself (a sibling): each call is accepted,
    as FSDP2 accepts it, and the first forward must raise."""
    errors = {}
    for second in ("root", "embedding"):
        model = tied_transformer()
        fsdp_traceable.fully_shard(model.output)
        if second == "root":
            shard_transformer(model, fsdp_traceable.fully_shard)
        else:
            fsdp_traceable.fully_shard(model.tok_embeddings)
        try:
            model.loss(*batch(0, rank, world_size))
        except ValueError as err:
            errors[second] = str(err)
        else:
            errors[second] = None
    return errors


def shard_embedding_separately(model: Transformer, fully_shard_fn, **kwargs) -> Transformer:
    """The token embedding as its own group (as torchtitan does), then blocks, then root."""
    fully_shard_fn(model.tok_embeddings, **kwargs)
    return shard_transformer(model, fully_shard_fn, **kwargs)


def embedding_own_group(rank: int, world_size: int) -> dict[str, Any]:
    """A group whose backward never needs its parameters: the backward prefetch of it
    goes unused, is finished at the backward's end (as FSDP2 does), and the next
    forward must not use that pre-step gather."""
    theirs, ours = shard_copies(seeded_transformer(), shard_fn=shard_embedding_separately)
    in_flight_after_backward = []

    def after_backward(model: nn.Module, micro: int, microbatches: int) -> None:
        in_flight_after_backward.append(
            model.tok_embeddings._fsdp_group.has_prefetch)

    results = {"theirs": train(theirs, rank, world_size, steps=3),
               "ours": train(ours, rank, world_size, steps=3, after_backward=after_backward)}
    results["ours"]["in_flight_after_backward"] = in_flight_after_backward
    return results
