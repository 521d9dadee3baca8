"""Rank-side bodies of the whole-step tests: forward, loss and backward compiled as one
graph by :func:`fsdp_traceable.compile_step`, torch's FSDP2 eager as the reference, on the
built-in transformer, Hugging Face's ``LlamaForCausalLM`` and, under Inductor with
forward regions, a small stack of LayerNorm MLP blocks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor

import fsdp_traceable
from fsdp_traceable.models.transformer import shard_transformer
from fsdp_traceable.tracing import regions_available
from tests.fsdp.parity_cases import LIBRARIES, UNEVEN, uneven_transformer
from tests.fsdp.parity_utils import batch, make_optimizer

STEPS = 3
MAX_NORM = 0.1


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train_each(rank: int, world_size: int, settings: tuple[bool | None, ...],
               backend: str, with_llama: bool) -> dict[Any, dict[str, Any]]:
    """:func:`train` per ``reshard_after_forward`` setting, with the optimizer traced
    into the step (key ``"optimizer in step"``), :func:`llama` (key ``"llama"``) if
    ``with_llama``, and :func:`inductor_regions` (key ``"inductor regions"``) where
    this torch has forward regions, in one rank run."""
    results: dict[Any, dict[str, Any]] = {
        setting: train(rank, world_size, setting, backend) for setting in settings}
    results["optimizer in step"] = train(rank, world_size, None, backend,
                                         optimizer_in_step=True)
    if with_llama:
        results["llama"] = llama(rank, world_size, backend)
    if regions_available():
        results["inductor regions"] = inductor_regions(rank, world_size)
    return results


class _NormMLP(nn.Module):
    """A residual LayerNorm MLP block (LayerNorm's backward reads the block's input)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _NormMLPStack(nn.Module):
    def __init__(self, vocab_size: int, dim: int = 16, hidden: int = 49, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(_NormMLP(dim, hidden) for _ in range(depth))
        self.output = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def _token_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def inductor_regions(rank: int, world_size: int) -> dict[str, Any]:
    """``STEPS`` AdamW steps of four LayerNorm MLP blocks (uneven shards; the second and
    fourth wrapped by torch's ``checkpoint_wrapper`` before ``fully_shard``), per library
    (:func:`_train`); ours compiled by Inductor with each block's forward a call of one
    of two regions (plain, checkpointed; ``config.forward_regions``), with Inductor's
    and AOTAutograd's caches off (a cached graph would not run the step's graph
    passes)."""
    torch.manual_seed(0)
    base = _NormMLPStack(UNEVEN.vocab_size)
    results = {}
    for name, fully_shard_fn in LIBRARIES:
        model = copy.deepcopy(base)
        for index in (1, 3):
            model.layers[index] = checkpoint_wrapper(model.layers[index], preserve_rng_state=False)
        for layer in model.layers:
            fully_shard_fn(layer)
        fully_shard_fn(model)
        with torch.compiler.config.patch(force_disable_caches=True):
            results[name] = _train(model, _token_loss, name != "theirs", rank, world_size,
                                   "inductor", forward_regions=True)
    return results


def train(rank: int, world_size: int, reshard_after_forward: bool | None,
          backend: str, optimizer_in_step: bool = False) -> dict[str, Any]:
    """``STEPS`` AdamW steps of the uneven two-block transformer, per library
    (:func:`_train`)."""
    base = uneven_transformer()
    return {name: _train(shard_transformer(copy.deepcopy(base), fully_shard_fn,
                                           reshard_after_forward=reshard_after_forward),
                         lambda model, tokens, targets: model.loss(tokens, targets),
                         name == "ours", rank, world_size, backend,
                         optimizer_in_step=optimizer_in_step)
            for name, fully_shard_fn in LIBRARIES}


def llama(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """The tiny Hugging Face ``LlamaForCausalLM`` built on meta and sharded per decoder
    layer and at the root (as ``tests/fsdp/parity_cases.llama_meta_init``), per library
    (:func:`_train`); ours with every decoder layer's forward one call of a shared
    region (``config.forward_regions``)."""
    from tests.fsdp import parity_cases

    reference_buffers = parity_cases.llama_buffers()
    return {name: _train(parity_cases.llama_from_meta(fully_shard_fn, reference_buffers),
                         # (no KV cache: a cache object passed to each layer keeps its
                         # forward out of a region)
                         lambda model, tokens, targets: model(
                             input_ids=tokens, labels=targets, use_cache=False).loss,
                         name == "ours", rank, world_size, backend,
                         forward_regions=regions_available())
            for name, fully_shard_fn in LIBRARIES}


def _train(model: torch.nn.Module, loss_of: Callable[..., torch.Tensor], whole_step: bool,
           rank: int, world_size: int, backend: str, forward_regions: bool = False,
           optimizer_in_step: bool = False) -> dict[str, Any]:
    """``STEPS`` AdamW steps of ``model``, eagerly or with the whole step compiled;
    ``optimizer_in_step``: the gradients clipped to a total norm of ``MAX_NORM`` in the
    step, under a learning rate halved every step, and compiled with the optimizer's
    update in the step (``compile_step(optimizer=...)``).

    Returns:
        ``losses``, ``norms`` (the gradients' total norms before clipping, with the
        optimizer in the step), ``grads`` (first step's local gradients and their placements; none
        with the optimizer in the step, which clears them), ``params`` (final local
        shards), ``state`` (each parameter's local optimizer state); compiled, also
        ``frames`` (graphs compiled over all steps), ``graph_breaks`` and ``regions``
        (the first graph's region calls and distinct regions).
    """
    optimizer = make_optimizer("adamw", model.parameters())
    schedule = (torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                if optimizer_in_step else None)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, tokens, targets)
        loss.backward()
        if not optimizer_in_step:
            return loss.detach()
        # torchtitan's order: the gradients clipped to a total norm, then the update.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        return torch.stack([loss.detach(), norm.full_tensor() if isinstance(norm, DTensor) else norm])

    counter = None
    if whole_step:
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend(backend)
        step = fsdp_traceable.compile_step(
            step, backend=counter, optimizer=optimizer if optimizer_in_step else None)
    losses, grads, norms = [], {}, []
    for index in range(STEPS):
        with fsdp_traceable.config.patch(forward_regions=forward_regions):
            loss = step(*batch(index, rank, world_size, UNEVEN))
        if optimizer_in_step:
            loss, norm = loss
            norms.append(norm.item())
        losses.append(loss.item())
        if index == 0 and not (whole_step and optimizer_in_step):
            grads = {n: (type(p.grad).__name__, p.grad.placements, _local(p.grad).clone())
                     for n, p in model.named_parameters()}
        if not (whole_step and optimizer_in_step):
            optimizer.step()
            optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    names = {p: n for n, p in model.named_parameters()}
    result = {"losses": losses, "grads": grads, "norms": norms,
              "params": {n: _local(p).detach().clone() for n, p in model.named_parameters()},
              "state": {names[p]: {k: _local(v).clone() for k, v in state.items()}
                        for p, state in optimizer.state.items()},
              "cleared": all(p.grad is None for p in model.parameters())}
    if counter is not None:
        result["frames"] = counter.frame_count
        result["graph_breaks"] = dict(counters["graph_break"])
        calls = [n for n in counter.graphs[0].graph.nodes
                 if n.target is torch.ops.higher_order.invoke_subgraph]
        result["regions"] = (len(calls), len({n.args[0].target for n in calls}))
    return result
