"""Rank-side bodies of ``tests/fsdp/test_late_attachment.py``: what a user changes or
attaches after ``fully_shard``, done to torch's FSDP2 and to ours the same way.

Every case takes ``(rank, world_size)``, shards two copies of one seeded transformer,
makes the same late change to each, trains both, and returns what the parent test
compares bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.fsdp.feature_cases import BF16_POLICY, seeded_transformer, train
from tests.fsdp.parity_utils import shard_copies


def _both(shard_kwargs: dict | None = None) -> dict[str, nn.Module]:
    theirs, ours = shard_copies(seeded_transformer(), **(shard_kwargs or {}))
    return {"theirs": theirs, "ours": ours}


def freeze_between_steps(rank: int, world_size: int) -> dict[str, Any]:
    """``requires_grad_(False)`` on block 0's attention after the first step, and back
    on after the second: FSDP2 reads ``requires_grad`` at every all-gather."""
    results = {}
    for name, model in _both().items():
        attention = model.layers[0].attention

        def hook(model: nn.Module, micro: int, microbatches: int, step=[0]) -> None:
            step[0] += 1
            if step[0] in (2, 3):
                attention.requires_grad_(step[0] == 2)
            grads = [p.grad is None for p in attention.parameters()]
            results.setdefault(name + "_none", []).append(grads)

        results[name] = train(model, rank, world_size, steps=3, before_microbatch=hook)
    return results


def _describe(tag: str, module: nn.Module, tensor: torch.Tensor) -> tuple:
    weight = module.attention.wq.weight
    kind = "DTensor" if isinstance(weight, DTensor) else "Tensor"
    return tag, kind, tuple(weight.shape), str(tensor.dtype)


def module_hooks(rank: int, world_size: int) -> dict[str, Any]:
    """Forward pre-hooks and forward hooks on a block, registered before ``fully_shard``
    and after it (with and without ``prepend``), and a full backward hook: what each sees
    of the block's parameters and tensors, and in which order they run."""
    base = seeded_transformer()
    block = base.layers[0]
    block.seen = []  # each sharded copy gets its own list
    block.register_forward_pre_hook(lambda m, args: m.seen.append(_describe("pre-before", m, args[0])))
    block.register_forward_hook(lambda m, args, out: m.seen.append(_describe("post-before", m, out)))
    theirs, ours = shard_copies(base, mp_policy=BF16_POLICY)
    results: dict[str, Any] = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        block = model.layers[0]
        block.register_forward_pre_hook(
            lambda m, args, kwargs: m.seen.append(_describe("pre-after", m, args[0])),
            with_kwargs=True)
        block.register_forward_pre_hook(
            lambda m, args: m.seen.append(_describe("pre-prepend", m, args[0])), prepend=True)
        block.register_forward_hook(
            lambda m, args, out: m.seen.append(_describe("post-after", m, out)))
        block.register_forward_hook(
            lambda m, args, out: m.seen.append(_describe("post-prepend", m, out)), prepend=True)
        block.register_full_backward_hook(
            lambda m, gin, gout: m.seen.append(("backward", gout[0].float().norm().item())))
        results[name] = train(model, rank, world_size, steps=2)
        results[name + "_seen"] = block.seen
    return results


def post_accumulate_grad_hook(rank: int, world_size: int) -> dict[str, Any]:
    """``register_post_accumulate_grad_hook`` on a sharded parameter, 3 microbatches a
    step, the first without gradient sync: fires on the sharded gradient after each
    reduction (none in the no-sync microbatch)."""
    results: dict[str, Any] = {}
    for name, model in _both().items():
        seen: list[Any] = []
        weight = model.layers[1].feed_forward.w1.weight
        weight.register_post_accumulate_grad_hook(
            lambda p: seen.append(None if p.grad is None else (
                type(p.grad).__name__, tuple(p.grad._local_tensor.shape),
                p.grad._local_tensor.clone())))

        def hook(model: nn.Module, micro: int, microbatches: int) -> None:
            model.set_requires_gradient_sync(micro > 0)

        results[name] = train(model, rank, world_size, steps=2, microbatches=3,
                              before_microbatch=hook)
        results[name + "_seen"] = seen
    return results


def settings_between_steps(rank: int, world_size: int) -> dict[str, Any]:
    """Reshard and reduction settings changed between steps."""
    results = {}
    for name, model in _both().items():
        def hook(model: nn.Module, micro: int, microbatches: int, step=[0]) -> None:
            step[0] += 1
            if step[0] == 2:
                model.set_reshard_after_forward(False)
                model.set_reshard_after_backward(False)
                model.set_gradient_divide_factor(float(world_size))
            if step[0] == 3:
                model.set_reshard_after_forward(True)
                model.set_reshard_after_backward(True)
                model.set_reduce_scatter_divide_factor(float(world_size))
                model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])

        results[name] = train(model, rank, world_size, steps=3, before_microbatch=hook)
    return results


def _halved(old: nn.Parameter) -> nn.Parameter:
    """A new parameter laid out as ``old``, with other values."""
    return nn.Parameter(DTensor.from_local(
        old.to_local().detach() * 0.5 + 0.01, old.device_mesh, old.placements,
        shape=old.shape, stride=old.stride()))


def replace_before_first_forward(rank: int, world_size: int) -> dict[str, Any]:
    """``module.weight = nn.Parameter(DTensor)`` after ``fully_shard``, before the first
    forward (FSDP2 adopts it at its lazy init)."""
    results = {}
    for name, model in _both().items():
        w1 = model.layers[0].feed_forward.w1
        w1.weight = _halved(w1.weight)
        results[name] = train(model, rank, world_size, steps=2)
    return results


def replace_between_steps(rank: int, world_size: int) -> dict[str, Any]:
    """The same replacement after the first step: ours adopts it (FSDP2 reverts it at
    its next unshard); FSDP2 gets the same values copied in place, so the next
    forward's loss must match."""
    results = {}
    for name, model in _both().items():
        w1 = model.layers[0].feed_forward.w1

        def hook(model: nn.Module, micro: int, microbatches: int, step=[0]) -> None:
            step[0] += 1
            if step[0] == 2:
                new = _halved(w1.weight)
                if name == "ours":
                    w1.weight = new
                else:
                    with torch.no_grad():
                        w1.weight.copy_(new)

        results[name] = {"losses": train(model, rank, world_size, steps=2,
                                         before_microbatch=hook)["losses"]}
    return results


def load_state_dict_assign(rank: int, world_size: int) -> dict[str, Any]:
    """``load_state_dict(state, assign=True)`` between steps, of the state before the
    first step: both adopt the loaded parameters (FSDP2 through its post-load hook)."""
    results = {}
    for name, model in _both().items():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def hook(model: nn.Module, micro: int, microbatches: int, step=[0]) -> None:
            step[0] += 1
            if step[0] == 2:
                model.load_state_dict(state, assign=True)

        results[name] = train(model, rank, world_size, steps=3, before_microbatch=hook)
    return results


def replace_with_plain_parameter(rank: int, world_size: int) -> dict[str, Any]:
    """``module.weight = nn.Parameter(plain tensor)`` after ``fully_shard``: FSDP2 fails
    at its first forward (``AttributeError``), ours at the assignment (``TypeError``)."""
    results: dict[str, Any] = {}
    for name, model in _both().items():
        w1 = model.layers[0].feed_forward.w1
        try:
            w1.weight = nn.Parameter(torch.zeros(w1.out_features, w1.in_features))
            train(model, rank, world_size, steps=1)
            results[name] = "no error"
        except Exception as error:  # noqa: BLE001
            results[name] = f"{type(error).__name__}: {error}"
    return results


def to_dtype_before_forward(rank: int, world_size: int) -> dict[str, Any]:
    """``model.to(torch.bfloat16)`` then ``model.float()`` after ``fully_shard``."""
    results = {}
    for name, model in _both().items():
        model.to(torch.bfloat16)
        results[name + "_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        model.float()
        results[name] = train(model, rank, world_size, steps=2)
    return results


def apply_init_between_steps(rank: int, world_size: int) -> dict[str, Any]:
    """``model.apply(init_fn)`` after a step: re-initializes the sharded parameters."""
    results = {}
    for name, model in _both().items():
        def init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                torch.manual_seed(7)
                nn.init.normal_(module.weight, std=0.02)

        def hook(model: nn.Module, micro: int, microbatches: int, step=[0]) -> None:
            step[0] += 1
            if step[0] == 2:
                model.apply(init)

        results[name] = train(model, rank, world_size, steps=3, before_microbatch=hook)
    return results
