"""Rank-side bodies of the compiled FSDP2 parity tests: our ``fully_shard`` under
``torch.compile(fullgraph=True)`` with compiled autograd, torch's FSDP2 eager as the
reference.

Every case returns plain results (and the graph breaks Dynamo counted while it ran);
:func:`~tests.fsdp.feature_cases.run_cases` runs a list of them on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.distributed_c10d import _resolve_process_group

import fsdp_traceable
from fsdp_traceable import compile_step
from fsdp_traceable.models.transformer import shard_transformer
from tests.fsdp import parity_cases
from tests.fsdp.parity_cases import LIBRARIES, UNEVEN, uneven_transformer
from tests.fsdp.parity_utils import (
    backward_context,
    batch,
    compile_backend,
    full_params,
    loss_fn,
    make_optimizer,
)

# Compiled autograd over Dynamo and AOTAutograd, without Inductor's code generation:
# with Inductor one of these cases takes about two minutes to compile on this machine.
MODE = "compile-ca-aot-eager"
# One block (a block group and the root group) keeps each compile to seconds; the
# shards stay uneven at 2 ranks (71 vocabulary rows, 17 positions, 51 hidden rows).
ONE_BLOCK = dataclasses.replace(UNEVEN, n_layers=1)
MICROBATCHES = 4


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break counter: reason -> count."""
    return dict(counters["graph_break"])


def with_graph_breaks(rank: int, world_size: int, name: str, *args: Any) -> dict[str, Any]:
    """Runs ``parity_cases.<name>(rank, world_size, *args)`` from a clean Dynamo state and
    adds the graph breaks Dynamo counted meanwhile (``graph_breaks``)."""
    torch._dynamo.reset()
    counters.clear()
    result = getattr(parity_cases, name)(rank, world_size, *args)
    result["graph_breaks"] = graph_breaks()
    return result


# -- gradient accumulation without sync ----------------------------------------------------


def no_sync_workaround(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """``MICROBATCHES`` microbatches per step, gradient sync off for all but the last.

    FSDP2 runs every microbatch eagerly. Ours runs the no-sync microbatches eagerly
    (forward and backward) and the last one, with sync on, compiled: forward under
    ``torch.compile(fullgraph=True)``, backward under compiled autograd, where the
    accumulated unsharded gradients join the reduce-scatter.

    Returns:
        Per library: ``grads`` (this rank's local gradients before each step),
        ``losses`` and ``params``; ours also ``graph_breaks``.
    """
    base = uneven_transformer(config=ONE_BLOCK)
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        torch._dynamo.reset()
        counters.clear()
        model = shard_transformer(copy.deepcopy(base), fully_shard_fn)
        optimizer = make_optimizer("adamw", model.parameters())
        compiled_loss = loss_fn(model, MODE) if name == "ours" else model.loss
        compiled_backward = backward_context(MODE if name == "ours" else "eager")
        losses, grads = [], []
        for step in range(steps):
            for micro in range(MICROBATCHES):
                last = micro == MICROBATCHES - 1
                model.set_requires_gradient_sync(last)
                data = batch(step * MICROBATCHES + micro, rank, world_size, ONE_BLOCK)
                if last:
                    loss = compiled_loss(*data)
                    with compiled_backward():
                        loss.backward()
                else:
                    loss = model.loss(*data)
                    loss.backward()
                losses.append(loss.item())
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {"losses": losses, "grads": grads, "params": full_params(model),
                        "graph_breaks": graph_breaks()}
    return result


# -- Hugging Face Llama ---------------------------------------------------------------------


def _llama_step(forward: Callable, backward_ctx: Callable, step: int, rank: int,
                world_size: int) -> torch.Tensor:
    tokens, targets = batch(step, rank, world_size, UNEVEN)
    loss = forward(input_ids=tokens, labels=targets).loss
    with backward_ctx():
        loss.backward()
    return loss


def llama_compiled(rank: int, world_size: int) -> dict[str, Any]:
    """The tiny ``LlamaForCausalLM``: graph breaks of one compiled training step
    unsharded and sharded, and 3 AdamW steps of ours compiled against FSDP2 eager.

    Both compiles are the same: ``torch.compile(model, backend="aot_eager")`` without
    ``fullgraph`` (so a break is counted, not raised) and backward under compiled
    autograd with the same backend. The unsharded model is built on CPU; the sharded
    ones on meta (per decoder layer, then the root), as
    :func:`~tests.fsdp.parity_cases.llama_meta_init` does.

    Returns:
        ``unsharded_breaks`` and ``sharded_breaks`` (reason -> count, first step), and
        per library ``losses`` and ``params``.
    """
    from transformers import LlamaForCausalLM

    backend = compile_backend(MODE)
    reference_buffers = parity_cases.llama_buffers()
    result: dict[str, Any] = {}

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(11)
    unsharded = LlamaForCausalLM(parity_cases.tiny_llama_config())
    _llama_step(torch.compile(unsharded, backend=backend), backward_context(MODE), 0, rank,
                world_size)
    result["unsharded_breaks"] = graph_breaks()

    for name, fully_shard_fn in LIBRARIES:
        torch._dynamo.reset()
        counters.clear()
        model = parity_cases.llama_from_meta(fully_shard_fn, reference_buffers)
        optimizer = make_optimizer("adamw", model.parameters())
        ours = name == "ours"
        forward = torch.compile(model, backend=backend) if ours else model
        backward_ctx = backward_context(MODE if ours else "eager")
        losses = []
        for step in range(3):
            losses.append(_llama_step(forward, backward_ctx, step, rank, world_size).item())
            if ours and step == 0:
                result["sharded_breaks"] = graph_breaks()
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {"losses": losses, "params": full_params(model)}
    return result


# -- reshard_after_forward=N ----------------------------------------------------------------


def gathered_ranks(node: torch.fx.Node) -> list[int]:
    """The global ranks of the process group an all-gather node gathers over."""
    group = _resolve_process_group(node.args[2])
    return dist.get_process_group_ranks(group)


def reshard_to_subgroups_compiled(rank: int, world_size: int, group_size: int
                                  ) -> dict[str, Any]:
    """``reshard_after_forward=group_size`` (torchtitan grouping, one block): FSDP2 eager
    against ours compiled whole with compiled autograd (AOT eager), 3 AdamW steps."""
    torch._dynamo.reset()
    counters.clear()
    result = parity_cases.train_modes(uneven_transformer(config=ONE_BLOCK), rank, world_size,
                                      parity_cases.titan_shard, MODE,
                                      reshard_after_forward=group_size)
    result["ours"]["graph_breaks"] = graph_breaks()
    return result


def reshard_to_subgroups_eager_forward_ca(rank: int, world_size: int, group_size: int
                                         ) -> dict[str, Any]:
    """``reshard_after_forward=group_size`` (torchtitan grouping, one block): ours with an
    eager forward and a compiled-autograd backward (AOT eager), as per-block compile
    runs, 3 AdamW steps on the data of :func:`reshard_to_subgroups_compiled` (whose
    FSDP2 run is the reference); also the ranks of every all-gather in the backward."""
    torch._dynamo.reset()
    counters.clear()
    model = parity_cases.titan_shard(uneven_transformer(config=ONE_BLOCK), fsdp_traceable.fully_shard,
                                     reshard_after_forward=group_size)
    backward = CompileCounterWithBackend("aot_eager")
    ours = parity_cases.run_steps(model, rank, world_size, "eager-ca-aot-eager", 3, ONE_BLOCK,
                                  backward_backend=backward)
    ours.update(graph_breaks=graph_breaks(), graphs=backward.frame_count,
                all_gather_ranks=[gathered_ranks(n) for n in backward.graphs[0].graph.nodes
                                  if "all_gather_into_tensor" in str(n.target)])
    return {"ours": ours}


def reshard_to_subgroups_whole_step(rank: int, world_size: int, group_size: int
                                    ) -> dict[str, Any]:
    """``reshard_after_forward=group_size`` (torchtitan grouping, one block): FSDP2 eager
    against ours with forward, loss and backward as one graph (``compile_step``, AOT
    eager), 3 AdamW steps; ours also the ranks of every all-gather in its graph and
    whether the backward issues it."""
    base = uneven_transformer(config=ONE_BLOCK)
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        torch._dynamo.reset()
        counters.clear()
        model = parity_cases.titan_shard(copy.deepcopy(base), fully_shard_fn,
                                         reshard_after_forward=group_size)
        optimizer = make_optimizer("adamw", model.parameters())
        graphs: list[torch.fx.GraphModule] = []

        def step(tokens: torch.Tensor, targets: torch.Tensor, model=model) -> torch.Tensor:
            loss = model.loss(tokens, targets)
            loss.backward()
            return loss.detach()

        def keep(gm: torch.fx.GraphModule, example_inputs: Any, graphs=graphs) -> Any:
            graphs.append(gm)
            return gm

        backend = aot_autograd(fw_compiler=keep, inference_compiler=keep)
        run = compile_step(step, backend=backend) if name == "ours" else step
        losses, grads = [], None
        for i in range(3):
            losses.append(run(*batch(i, rank, world_size, ONE_BLOCK)).item())
            if grads is None:
                grads = [p.grad.to_local().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {"losses": losses, "grads": grads, "params": full_params(model),
                        "graph_breaks": graph_breaks(),
                        "graphs": len(graphs),
                        "all_gather_ranks": [(gathered_ranks(n), bool(n.meta.get("autograd_backward")))
                                             for gm in graphs[:1] for n in gm.graph.nodes
                                             if "all_gather_into_tensor" in str(n.target)]}
    return result
