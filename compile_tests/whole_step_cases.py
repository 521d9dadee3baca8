"""Rank-side bodies of the whole-step tests: forward, loss and backward compiled as one
graph by :func:`fsdp_traceable.compile_step`, torch's FSDP2 eager as the reference, on the
built-in transformer and Hugging Face's ``LlamaForCausalLM``."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

import fsdp_traceable
from fsdp_traceable.models.transformer import shard_transformer
from tests.fsdp.parity_cases import LIBRARIES, uneven_transformer
from tests.fsdp.parity_utils import batch, make_optimizer

STEPS = 3


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train_each(rank: int, world_size: int, settings: tuple[bool | None, ...],
               backend: str, with_llama: bool) -> dict[Any, dict[str, Any]]:
    """:func:`train` per ``reshard_after_forward`` setting, and :func:`llama` (key
    ``"llama"``) if ``with_llama``, in one rank run."""
    results: dict[Any, dict[str, Any]] = {
        setting: train(rank, world_size, setting, backend) for setting in settings}
    if with_llama:
        results["llama"] = llama(rank, world_size, backend)
    return results


def train(rank: int, world_size: int, reshard_after_forward: bool | None,
          backend: str) -> dict[str, Any]:
    """``STEPS`` AdamW steps of the uneven two-block transformer, per library.

    Returns:
        Per library: ``losses``, ``grads`` (first step's local gradients and their
        placements), ``params`` (final local shards); ours also ``frames`` (graphs
        compiled over all steps) and ``graph_breaks``.
    """
    base = uneven_transformer()
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        model = shard_transformer(copy.deepcopy(base), fully_shard_fn,
                                  reshard_after_forward=reshard_after_forward)
        optimizer = make_optimizer("adamw", model.parameters())

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = model.loss(tokens, targets)
            loss.backward()
            return loss.detach()

        counter = None
        if name == "ours":
            torch._dynamo.reset()
            counters.clear()
            counter = CompileCounterWithBackend(backend)
            step = fsdp_traceable.compile_step(step, backend=counter)
        losses, grads = [], {}
        for index in range(STEPS):
            losses.append(step(*batch(index, rank, world_size)).item())
            if index == 0:
                grads = {n: (type(p.grad).__name__, p.grad.placements, _local(p.grad).clone())
                         for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {
            "losses": losses,
            "grads": grads,
            "params": {n: _local(p).detach().clone() for n, p in model.named_parameters()},
        }
        if counter is not None:
            result[name]["frames"] = counter.frame_count
            result[name]["graph_breaks"] = dict(counters["graph_break"])
    return result


def llama(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """The tiny Hugging Face ``LlamaForCausalLM`` built on meta and sharded per decoder
    layer and at the root (as ``tests/fsdp/parity_cases.llama_meta_init``): ``STEPS``
    AdamW steps, FSDP2 eager against ours with the whole step compiled.

    Returns:
        Per library ``losses`` and ``params`` (final local shards); ours also ``frames``
        and ``graph_breaks``.
    """
    from tests.fsdp import parity_cases
    from tests.fsdp.parity_cases import UNEVEN

    reference_buffers = parity_cases.llama_buffers()
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        model = parity_cases.llama_from_meta(fully_shard_fn, reference_buffers)
        optimizer = make_optimizer("adamw", model.parameters())

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=tokens, labels=targets).loss
            loss.backward()
            return loss.detach()

        counter = None
        if name == "ours":
            torch._dynamo.reset()
            counters.clear()
            counter = CompileCounterWithBackend(backend)
            step = fsdp_traceable.compile_step(step, backend=counter)
        losses = []
        for index in range(STEPS):
            losses.append(step(*batch(index, rank, world_size, UNEVEN)).item())
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {"losses": losses,
                        "params": {n: _local(p).detach().clone() for n, p in model.named_parameters()}}
        if counter is not None:
            result[name]["frames"] = counter.frame_count
            result[name]["graph_breaks"] = dict(counters["graph_break"])
    return result
