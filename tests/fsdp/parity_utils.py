"""Shared pieces of the fully_shard parity tests: models, data, the three training modes."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_traceable
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)

SMALL = TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
BATCH, SEQ = 2, 16


def batch(step: int, rank: int, world_size: int, config: TransformerConfig = SMALL):
    """Rank ``rank``'s batch of step ``step``: the same on every run."""
    generator = torch.Generator().manual_seed(1000 + step * world_size + rank)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    return tokens, targets


def make_models(config: TransformerConfig = SMALL, seed: int = 0, **shard_kwargs):
    """(unsharded reference, torch FSDP2 model, fsdp_traceable model) from one init."""
    torch.manual_seed(seed)
    base = Transformer(config)
    theirs, ours = shard_copies(base, **shard_kwargs)
    return base, theirs, ours


def shard_copies(
    base: nn.Module, shard_fn: Callable[..., nn.Module] = shard_transformer, **shard_kwargs
) -> tuple[nn.Module, nn.Module]:
    """(torch FSDP2 copy, fsdp_traceable copy) of ``base``, each sharded by ``shard_fn``.

    Args:
        base: the unsharded model; left untouched.
        shard_fn: ``shard_fn(model, fully_shard_fn, **shard_kwargs)`` applies one
            library's ``fully_shard`` to ``model`` (default: per block, then the root).
        shard_kwargs: passed to both libraries' ``fully_shard`` (e.g. ``mesh=``).

    Returns:
        The two sharded copies.
    """
    theirs = shard_fn(copy.deepcopy(base), fsdp2_fully_shard, **shard_kwargs)
    ours = shard_fn(copy.deepcopy(base), fsdp_traceable.fully_shard, **shard_kwargs)
    return theirs, ours


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "adamw":
        # eps well above fp32 round-off in the gradients: with a tiny eps Adam turns
        # ulp-level noise in near-zero gradient entries into full-size updates, and
        # any two correct implementations (eager vs Inductor) drift apart by ~lr.
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1)
    raise ValueError(kind)


def compile_backend(mode: str) -> str:
    """The backend of a compiled mode: a ``-aot-eager`` mode (e.g. ``compile-ca-aot-eager``)
    stops after AOTAutograd, skipping Inductor's code generation (seconds instead of
    minutes of compile on this machine); the others use Inductor."""
    return "aot_eager" if mode.endswith("-aot-eager") else "inductor"


def backward_context(mode: str, backend=None) -> Callable[[], contextlib.AbstractContextManager]:
    """Compiled autograd around ``loss.backward()`` for the ``compile-ca`` modes and the
    ``eager-ca`` ones (an eager forward), compiled with ``backend`` if given (e.g. a
    ``CompileCounterWithBackend`` that keeps the graphs)."""
    if mode.startswith(("compile-ca", "eager-ca")):
        compiler = torch.compile(backend=backend or compile_backend(mode), fullgraph=True)
        return lambda: torch._dynamo.compiled_autograd._enable(compiler)
    return contextlib.nullcontext


def loss_fn(model: nn.Module, mode: str):
    if mode == "eager" or mode.startswith("eager-"):
        return model.loss
    return torch.compile(model.loss, backend=compile_backend(mode), fullgraph=True)


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def reference_step(model: nn.Module, optimizer, step: int, world_size: int, config=SMALL) -> float:
    """One unsharded step on the data of every rank: the mean of the per-rank losses."""
    losses = [model.loss(*batch(step, r, world_size, config)) for r in range(world_size)]
    loss = torch.stack(losses).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def all_ranks_mean(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()
