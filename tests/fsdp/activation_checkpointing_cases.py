"""Rank-side bodies of the activation-checkpointing tests: each block of the uneven
transformer checkpointed (full AC, or selective AC with an op policy as torchtitan's) and
sharded in one of four arrangements, trained with torch's FSDP2 (eager) and with ours.

The arrangements: ``ac_then_fsdp`` (torchtitan's ``apply_ac`` then ``fully_shard``: the
group's module is the checkpoint wrapper), ``fsdp_then_ac`` (the wrapper around a
sharded block), ``nested`` (a sharded feed-forward inside a checkpointed, sharded
block) and ``function`` (a sharded module whose forward calls
``torch.utils.checkpoint.checkpoint`` on its block).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdp_traceable.cli.memory import peak_allocated_bytes
from fsdp_traceable.models.transformer import Transformer, TransformerBlock, TransformerConfig
from tests.fsdp.feature_cases import record_all_gathers
from tests.fsdp.parity_cases import LIBRARIES, run_steps, uneven_transformer
from tests.fsdp.parity_utils import compile_backend

ORDERS = ("ac_then_fsdp", "fsdp_then_ac", "nested", "function")

# What selective AC keeps: matmul outputs (torchtitan's op list keeps these and the
# attention kernels); everything else is recomputed.
_SAVED_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                        torch.ops.aten.bmm.default})


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """Selective AC's ``context_fn`` (module-level: Dynamo traces only such a one)."""
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpoint_kwargs(ac: str) -> dict[str, Any]:
    return {"context_fn": selective_context} if ac == "selective" else {}


class FunctionCheckpoint(nn.Module):
    """A module whose forward checkpoints its block with the function form."""

    def __init__(self, block: nn.Module, ac: str) -> None:
        super().__init__()
        self.block = block
        self._kwargs = _checkpoint_kwargs(ac)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, **self._kwargs)


def checkpoint_and_shard(model: Transformer, fully_shard_fn: Callable, order: str, ac: str,
                         compile_backend: str | None = None, **kwargs: Any) -> Transformer:
    """Checkpoints every block of ``model`` and shards it (blocks, then the root) in
    ``order`` (see the module docstring); with ``compile_backend``, each block compiled
    (``module.compile``): torchtitan's recipe (AC, then compile, then ``fully_shard``) or
    the checkpoint wrapper around the sharded block compiled."""
    for i, layer in enumerate(model.layers):
        if compile_backend is not None and order == "ac_then_fsdp":
            wrapped = checkpoint_wrapper(layer, **_checkpoint_kwargs(ac))
            wrapped.compile(backend=compile_backend, fullgraph=True)
            model.layers[i] = fully_shard_fn(wrapped, **kwargs)
        elif compile_backend is not None:
            assert order == "fsdp_then_ac", order
            model.layers[i] = checkpoint_wrapper(fully_shard_fn(layer, **kwargs),
                                                 **_checkpoint_kwargs(ac))
            model.layers[i].compile(backend=compile_backend, fullgraph=True)
        elif order == "ac_then_fsdp":
            model.layers[i] = fully_shard_fn(checkpoint_wrapper(layer, **_checkpoint_kwargs(ac)),
                                             **kwargs)
        elif order == "fsdp_then_ac":
            model.layers[i] = checkpoint_wrapper(fully_shard_fn(layer, **kwargs),
                                                 **_checkpoint_kwargs(ac))
        elif order == "nested":
            fully_shard_fn(layer.feed_forward, **kwargs)
            model.layers[i] = fully_shard_fn(checkpoint_wrapper(layer, **_checkpoint_kwargs(ac)),
                                             **kwargs)
        elif order == "function":
            model.layers[i] = fully_shard_fn(FunctionCheckpoint(layer, ac), **kwargs)
        else:
            raise ValueError(order)
    fully_shard_fn(model, **kwargs)
    return model


def _count_block_forwards(model: nn.Module) -> list[int]:
    """A counter of the blocks' forward calls (a recompute runs a block's forward again)."""
    calls = [0]

    def count(module: nn.Module, args: Any) -> None:
        calls[0] += 1

    for module in model.modules():
        if isinstance(module, TransformerBlock):
            module.register_forward_pre_hook(count)
    return calls


def checkpointed_training(rank: int, world_size: int, order: str, ac: str,
                          mode: str = "eager", steps: int = 2) -> dict[str, Any]:
    """Trains FSDP2 eagerly and ours in ``mode`` (AdamW, the uneven transformer):
    ``run_steps``' modes, or ``block-aot-eager`` (each block compiled, see
    :func:`checkpoint_and_shard`; the rest eager).

    Returns:
        ``{"theirs": ..., "ours": ...}``: ``run_steps``' results plus ``block_forwards``
        (forward calls of the blocks, recomputes included) and ``all_gathers`` (the
        eager c10d all-gathers issued).
    """
    base = uneven_transformer()
    result = {}
    for name, fully_shard_fn in LIBRARIES:
        run_mode = mode if name == "ours" else "eager"
        blocks_backend = None
        if run_mode.startswith("block-"):
            blocks_backend, run_mode = compile_backend(run_mode), "eager-blocks"
        model = checkpoint_and_shard(copy.deepcopy(base), fully_shard_fn, order, ac,
                                     compile_backend=blocks_backend)
        # Counted eagerly only: a hook's count is a side effect Dynamo refuses in a region.
        calls = _count_block_forwards(model) if run_mode == "eager" else [None]
        torch._dynamo.reset()
        with record_all_gathers(lambda output, input, group: None) as gathers:
            result[name] = run_steps(model, rank, world_size, run_mode, steps)
        result[name]["block_forwards"] = calls[0]
        result[name]["all_gathers"] = len(gathers)
    return result


# Activations matter at this size, as in real training (see test_fully_shard_eager).
PEAK_CONFIG = TransformerConfig(vocab_size=256, dim=128, n_layers=3, n_heads=4, max_seq_len=64)


def checkpointed_peaks(rank: int, world_size: int, order: str, ac: str) -> dict[str, int]:
    """Each library's least disturbed peak of host bytes allocated on the calling thread
    over a checkpointed training step (forward and backward, batch 8 x 64 tokens), after
    a warm-up step; see ``peak_allocated_bytes``."""
    torch.manual_seed(0)
    base = Transformer(PEAK_CONFIG)
    generator = torch.Generator().manual_seed(rank)
    data = tuple(torch.randint(0, PEAK_CONFIG.vocab_size, (8, PEAK_CONFIG.max_seq_len),
                               generator=generator) for _ in range(2))
    models = {name: checkpoint_and_shard(copy.deepcopy(base), fully_shard_fn, order, ac)
              for name, fully_shard_fn in LIBRARIES}
    peaks: dict[str, list[int]] = {name: [] for name in models}
    for repeat in range(4):
        for name, model in models.items():
            peak = peak_allocated_bytes(lambda: model.loss(*data).backward(),
                                        caller_thread_only=True)
            if repeat:  # the first is the warm-up
                peaks[name].append(peak)
            model.zero_grad(set_to_none=True)
    return {name: min(values) for name, values in peaks.items()}
