"""Rank-side bodies of the backward-finalization tests (FSDP2 2.15's manual backward
finalization, ``reset_iter_state`` after a failed backward, and kept unsharded
storage): each shards one model with both libraries, drives both the same way and
returns what the test compares bit for bit (see :func:`~tests.fsdp.feature_cases.train`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.fsdp.feature_cases import fsdp_modules, seeded_transformer, train
from tests.fsdp.features.pipeline_parallel_cases import counting_collectives
from tests.fsdp.parity_utils import batch, full_params, make_optimizer, shard_copies


def _error(fn: Callable[[], Any]) -> str | None:
    """``"Type: message"`` of what ``fn()`` raises, or ``None``."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (compared between the libraries)
        return f"{type(error).__name__}: {error}"
    return None


def manual_accumulation(rank: int, world_size: int, async_op: bool, sync_each: bool,
                        hsdp: bool = False) -> dict[str, Any]:
    """3 microbatches per step under ``set_manual_backward_finalization(True)``: gradient
    sync off for all but the last (or on for each with ``sync_each``), then
    ``finalize_backward(async_op=...)`` (and the handle's ``wait()``), as FSDP2 documents."""
    mesh = None
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    theirs, ours = shard_copies(seeded_transformer(), **({"mesh": mesh} if mesh else {}))
    handles: dict[str, list[str]] = {"theirs": [], "ours": []}

    def before(model: nn.Module, micro: int, microbatches: int) -> None:
        if micro == 0:
            model.set_manual_backward_finalization(True)
        model.set_requires_gradient_sync(sync_each)

    def after(model: nn.Module, micro: int, microbatches: int) -> None:
        if micro < microbatches - 1:
            return
        name = "ours" if model is ours else "theirs"
        model.set_requires_gradient_sync(True)
        if async_op:
            handle = model.finalize_backward(async_op=True)
            handles[name].append(type(handle).__mro__[1].__qualname__)
            handle.wait()
        else:
            assert model.finalize_backward() is None
        model.set_manual_backward_finalization(False)

    result: dict[str, Any] = {"handles": handles}
    for name, model in (("theirs", theirs), ("ours", ours)):
        with counting_collectives() as counts:
            result[name] = train(model, rank, world_size, microbatches=3,
                                 before_microbatch=before, after_backward=after)
        result[name]["counts"] = counts
    return result


def _misuse(model: nn.Module, rank: int, world_size: int) -> dict[str, str | None]:
    """The errors of FSDP2's documented misuses, in one sequence of calls on ``model``."""
    errors: dict[str, str | None] = {}
    blocks = [m for m in fsdp_modules(model) if m is not model]
    tokens, targets = batch(0, rank, world_size)
    errors["finalize_before_forward"] = _error(model.finalize_backward)
    model.loss(tokens, targets).backward()
    # (before the first forward FSDP2 accepts it, and its first forward raises)
    errors["manual_on_non_root"] = _error(lambda: blocks[0].set_manual_backward_finalization(True))
    errors["finalize_without_manual"] = _error(model.finalize_backward)
    errors["finalize_on_non_root"] = _error(lambda: blocks[0].finalize_backward())
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    model.loss(tokens, targets).backward()
    errors["mode_change_after_backward"] = _error(
        lambda: model.set_manual_backward_finalization(False))
    model.set_requires_gradient_sync(True)
    handle = model.finalize_backward(async_op=True)
    errors["forward_while_pending"] = _error(lambda: model.loss(tokens, targets))
    errors["finalize_while_pending"] = _error(model.finalize_backward)
    handle.wait()
    errors["wait_twice"] = _error(handle.wait)
    model.set_manual_backward_finalization(False)
    # A handle that reset_iter_state invalidated.
    model.set_manual_backward_finalization(True)
    model.loss(tokens, targets).backward()
    handle = model.finalize_backward(async_op=True)
    errors["reset_on_non_root"] = _error(blocks[0].reset_iter_state)
    model.reset_iter_state()
    errors["wait_after_reset"] = _error(handle.wait)
    errors["grads_after_reset"] = str([p.grad is None for p in model.parameters()])
    model.set_manual_backward_finalization(False)
    return errors


def misuse_errors(rank: int, world_size: int) -> dict[str, Any]:
    theirs, ours = shard_copies(seeded_transformer())
    return {"theirs": _misuse(theirs, rank, world_size), "ours": _misuse(ours, rank, world_size)}


def hsdp_partial_reduction_refused(rank: int, world_size: int) -> dict[str, Any]:
    """HSDP: finalizing with the all-reduce off raises, in both libraries, the same error."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    result = {}
    for name, model in zip(("theirs", "ours"), shard_copies(seeded_transformer(), mesh=mesh)):
        model.set_manual_backward_finalization(True)
        model.set_requires_gradient_sync(False)
        model.loss(*batch(0, rank, world_size)).backward()
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(False)
        result[name] = _error(model.finalize_backward)
        model.reset_iter_state()
    return result


class _FailingBackward(Exception):
    pass


def reset_after_failed_backward(rank: int, world_size: int) -> dict[str, Any]:
    """A backward that raises half-way (after the later blocks reduced), then
    ``reset_iter_state()`` on the root and two normal steps."""
    result = {}
    for name, model in zip(("theirs", "ours"), shard_copies(seeded_transformer())):
        optimizer = make_optimizer("adamw", model.parameters())
        handle = model.layers[0].register_forward_hook(_raise_in_backward)
        with contextlib.suppress(_FailingBackward, RuntimeError):
            model.loss(*batch(0, rank, world_size)).backward()
        handle.remove()
        model.reset_iter_state()
        grads_none = [p.grad is None for p in model.parameters()]
        losses = []
        for step in range(1, 3):
            loss = model.loss(*batch(step, rank, world_size))
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {"grads_none": grads_none, "losses": losses, "params": full_params(model)}
    return result


def _raise_in_backward(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    output.register_hook(_raise)


def _raise(grad: torch.Tensor) -> None:
    raise _FailingBackward("a failing backward")


def keep_unsharded_storage(rank: int, world_size: int) -> dict[str, Any]:
    """``set_keep_unsharded_storage(True)``: the same training, and each block's
    unsharded parameter keeps its data pointer from one unshard to the next."""
    result = {}
    for name, model in zip(("theirs", "ours"), shard_copies(seeded_transformer())):
        model.set_keep_unsharded_storage(True)
        pointers = []
        for _ in range(2):
            block = model.layers[0]
            block.unshard()
            pointers.append([p.data_ptr() for p in block.parameters()])
            block.reshard()
        result[name] = train(model, rank, world_size, steps=2)
        result[name]["same_pointers"] = pointers[0] == pointers[1]
    return result
