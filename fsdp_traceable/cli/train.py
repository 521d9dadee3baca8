"""``python -m fsdp_traceable train``: the built-in transformer trained with fully_shard."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..fsdp import fully_shard
from ..models.transformer import (
    Transformer,
    check_tensor_parallel,
    parallelize_transformer,
    shard_transformer,
)
from ..whole_step.capture import compile_step
from .arguments import WHOLE_STEP_MODES, TrainArgs
from .data import synthetic_batch
from .launch import launched_by_torchrun, resolve_device, run_on_ranks
from .pipeline import build_pipeline
from .progress import say, still_running


def make_optimizer(args: TrainArgs, params) -> torch.optim.Optimizer:
    """``--optimizer``: AdamW (default) or plain SGD, at ``--lr``."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr)


def train_args_from(namespace: argparse.Namespace) -> TrainArgs:
    fields = TrainArgs.__dataclass_fields__
    args = TrainArgs(**{k: v for k, v in vars(namespace).items() if k in fields})
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.dim % args.heads:
        raise ValueError(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if args.hsdp and args.world_size % 2:
        raise ValueError(f"--hsdp needs an even world size, got {args.world_size}")
    if args.tp < 1 or args.world_size % args.tp:
        raise ValueError(f"--tp {args.tp} must be at least 1 and divide --world-size "
                         f"{args.world_size}")
    if args.tp > 1 and args.hsdp:
        raise ValueError("--tp with --hsdp is not supported by the CLI: use one of them")
    if args.pp < 1 or args.world_size % args.pp:
        raise ValueError(f"--pp {args.pp} must be at least 1 and divide --world-size "
                         f"{args.world_size}")
    if args.pp > 1:
        if args.tp > 1 or args.hsdp:
            raise ValueError("--pp with --tp or --hsdp is not supported by the CLI: use one")
        if args.mode != "eager":
            raise ValueError(f"--pp runs --mode eager only in the CLI, got --mode {args.mode}")
        if args.pp > args.layers:
            raise ValueError(f"--pp {args.pp} needs at least as many --layers, got {args.layers}")
        if args.batch_size % args.pp:
            raise ValueError(f"--batch-size {args.batch_size} must divide into --pp {args.pp} "
                             "microbatches")
    check_tensor_parallel(args.config, args.tp)
    return args


def build_model(args: TrainArgs, device: str) -> Transformer:
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Transformer(args.config)
    world_size = dist.get_world_size()
    if args.tp > 1:
        mesh = init_device_mesh(device, (world_size // args.tp, args.tp),
                                mesh_dim_names=("dp", "tp"))
        parallelize_transformer(model, mesh["tp"])
        mesh = mesh["dp"]
    elif args.hsdp:
        mesh = init_device_mesh(device, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (world_size,))
    return shard_transformer(model, fully_shard, mesh=mesh, mp_policy=mp_policy_for(args))


def mp_policy_for(args: TrainArgs) -> MixedPrecisionPolicy:
    """``--mp bf16``: bf16 parameters and compute, fp32 gradient reduction."""
    if args.mp == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def batch_for(args: TrainArgs, step: int, rank: int, world_size: int, device: str):
    tokens, targets = synthetic_batch(step, rank, world_size, batch_size=args.batch_size,
                                      seq_len=args.seq_len, vocab_size=args.vocab_size,
                                      seed=args.seed)
    return tokens.to(device), targets.to(device)


def reference_losses(args: TrainArgs, world_size: int) -> list[float]:
    """The same steps on one unsharded fp32 model fed every rank's batch."""
    torch.manual_seed(args.seed)
    model = Transformer(args.config)
    optimizer = make_optimizer(args, model.parameters())
    losses = []
    for step in range(args.steps):
        loss = torch.stack([
            model.loss(*batch_for(args, step, r, world_size, "cpu")) for r in range(world_size)
        ]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def forward_backward_of(model: nn.Module, *, compiled_forward: bool = False,
                        compiled_autograd: bool = False, whole_step: bool = False,
                        forward_backend: Any = "inductor", backward_backend: Any = "inductor",
                        optimizer: torch.optim.Optimizer | None = None,
                        options: dict[str, Any] | None = None,
                        ) -> Callable[..., torch.Tensor]:
    """``fn(tokens, targets)``: the forward, loss and backward of one step, returning the
    detached loss.

    Args:
        model: a model with ``loss(tokens, targets)``.
        compiled_forward: ``torch.compile(model.loss, fullgraph=True)``.
        compiled_autograd: the backward under compiled autograd.
        whole_step: forward, loss and backward as one graph (:func:`compile_step`);
            excludes the other two.
        forward_backend: the backend of the forward (or the whole step).
        backward_backend: compiled autograd's backend.
        optimizer: with ``whole_step``, the optimizer whose step and ``zero_grad()``
            end the compiled step (``compile_step(optimizer=...)``).
        options: Inductor options of every compile (forward, compiled autograd's
            backward, the whole step); ``None``: Inductor's defaults.
    """
    assert not (whole_step and (compiled_forward or compiled_autograd))
    assert optimizer is None or whole_step
    loss_fn = (torch.compile(model.loss, backend=forward_backend, fullgraph=True, options=options)
               if compiled_forward else model.loss)
    backward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if compiled_autograd:
        compiler = torch.compile(backend=backward_backend, fullgraph=True, options=options)
        backward_context = lambda: torch._dynamo.compiled_autograd._enable(compiler)  # noqa: E731

    def forward_backward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(tokens, targets)
        with backward_context():
            loss.backward()
        return loss.detach()

    if not whole_step:
        return forward_backward
    return compile_step(forward_backward, backend=forward_backend, optimizer=optimizer,
                        options=options)


def first_step_description(args: TrainArgs) -> str:
    """What the first step of ``args.mode`` does beyond a training step: what it compiles."""
    if args.mode == "eager":
        return "step 1 runs eagerly: nothing to compile"
    compiled = {
        "compile": "the forward and loss (torch.compile)",
        "compile-ca": "the forward and loss (torch.compile), then the backward "
                      "(compiled autograd)",
        "whole-step": "forward, loss and backward as one graph (compile_step)",
        "whole-step-optim": "forward, loss, backward and the optimizer step as one graph "
                            "(compile_step)",
    }[args.mode]
    return (f"step 1 compiles {compiled} with backend {args.backend}: on CPU a first "
            "compile takes a minute or more")


def _train_rank(args: TrainArgs, result_path: str, started: float) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = resolve_device(args.device)
    if rank == 0:
        say(f"{world_size} ranks up ({device}); building the model ({args.layers} blocks, "
            f"dim {args.dim}) and sharding it", started)
    forward_counter = CompileCounterWithBackend(args.backend)
    backward_counter = CompileCounterWithBackend(args.backend)
    if args.pp > 1:
        pipeline, dp_rank, dp_size = build_pipeline(args.config, args.pp, args.pp, device,
                                                    mp_policy_for(args), args.seed)
        forward_backward = pipeline
        optimizer = make_optimizer(args, pipeline.stage.parameters())
        loss_holders = dp_size  # the last stage's ranks
    else:
        # The ranks of one tensor-parallel group (consecutive ranks) train on the same batch.
        dp_rank, dp_size = rank // args.tp, world_size // args.tp
        model = build_model(args, device)
        optimizer = make_optimizer(args, model.parameters())
        forward_backward = forward_backward_of(
            model, compiled_forward=args.mode in ("compile", "compile-ca"),
            compiled_autograd=args.mode == "compile-ca", whole_step=args.mode in WHOLE_STEP_MODES,
            forward_backend=forward_counter, backward_backend=backward_counter,
            optimizer=optimizer if args.mode == "whole-step-optim" else None)
        loss_holders = world_size
    optimizer_in_step = args.mode == "whole-step-optim"
    losses, step_times = [], []
    if rank == 0:
        say(first_step_description(args), started)
    for step in range(args.steps):
        start = time.perf_counter()
        watch = (still_running("compiling step 1" if args.mode != "eager" else "in step 1",
                               started)
                 if rank == 0 and step == 0 else contextlib.nullcontext())
        with watch:
            loss = forward_backward(*batch_for(args, step, dp_rank, dp_size, device))
            if not optimizer_in_step:
                optimizer.step()
                optimizer.zero_grad()
            mean_loss = (torch.zeros((), device=device) if loss is None
                         else loss.detach().float().clone())
            dist.all_reduce(mean_loss)
        step_times.append(time.perf_counter() - start)
        losses.append(mean_loss.item() / loss_holders)
        if rank == 0:
            if step == 0:
                say(f"step 1 done in {step_times[0]:.1f} s; training {args.steps} steps",
                    started)
            _progress(step + 1, args.steps, losses[-1], step_times[-1])
    if rank == 0:
        print(file=sys.stderr)
        result = {
            "losses": losses,
            "step_times_s": step_times,
            "forward_graphs": forward_counter.frame_count,
            "backward_graphs": backward_counter.frame_count,
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": list(counters["graph_break"]),
            "recompiles": max(0, forward_counter.frame_count - 1)
            + max(0, backward_counter.frame_count - 1),
        }
        with open(result_path, "w") as f:
            json.dump(result, f)


def _progress(step: int, steps: int, loss: float, step_time: float) -> None:
    width = 30
    filled = width * step // steps
    bar = "#" * filled + "-" * (width - filled)
    print(f"\r[{bar}] step {step}/{steps}  loss {loss:.4f}  {step_time * 1e3:7.1f} ms/step",
          end="", file=sys.stderr, flush=True)


def train(args: TrainArgs, started: float | None = None) -> dict:
    """Trains on every rank and returns rank 0's summary (with the unsharded reference).

    Args:
        args: the run's settings.
        started: when the command started (``time.time()``), the zero of the progress
            lines on standard error; ``None``: now.

    Returns:
        A dict with per-step losses and times, the reference losses, the final loss
        difference, and for compiled modes the graph, graph-break and recompile counts.
    """
    started = time.time() if started is None else started
    if not launched_by_torchrun():
        say(f"starting {args.world_size} local ranks; each imports torch before it "
            "says more", started)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        run_on_ranks(_train_rank, args, result_path, started, world_size=args.world_size,
                     device=args.device)
        if not os.path.exists(result_path):  # another rank of a torchrun job
            return {}
        with open(result_path) as f:
            result = json.load(f)
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    say(f"ranks done; the unsharded reference: {args.steps} steps in this process", started)
    reference = reference_losses(args, world_size // (args.tp * args.pp))
    result["reference_losses"] = reference
    result["final_loss_difference"] = result["losses"][-1] - reference[-1]
    result["args"] = asdict(args)
    return result


def format_summary(result: dict) -> str:
    args = result["args"]
    steady = sorted(result["step_times_s"][1:] or result["step_times_s"])
    mode = args["mode"] if args["mode"] == "eager" else f"{args['mode']} (backend {args['backend']})"
    tp, pp = args.get("tp", 1), args.get("pp", 1)
    lines = [
        f"mode {mode}, {args['steps']} steps, world size "
        f"{args['world_size']}{' (HSDP)' if args['hsdp'] else ''}"
        f"{f', tensor parallel {tp}' if tp > 1 else ''}"
        f"{f', pipeline parallel {pp} (GPipe)' if pp > 1 else ''}"
        f"{', bf16 mixed precision' if args['mp'] else ''}",
        f"final loss           {result['losses'][-1]:.6f}  (first {result['losses'][0]:.4f}, "
        f"log(vocab) {math.log(args['vocab_size']):.4f})",
        f"unsharded reference  {result['reference_losses'][-1]:.6f}  "
        f"(difference {result['final_loss_difference']:+.2e})",
        f"step time            first {result['step_times_s'][0] * 1e3:.1f} ms, median after "
        f"{steady[len(steady) // 2] * 1e3:.1f} ms",
    ]
    if args["mode"] in WHOLE_STEP_MODES:
        lines.append(
            f"compiled             {result['forward_graphs']} whole-step graph(s), "
            f"{result['graph_breaks']} graph break(s), {result['recompiles']} recompile(s)"
        )
    elif args["mode"] != "eager":
        lines.append(
            f"compiled             {result['forward_graphs']} forward graph(s), "
            f"{result['backward_graphs']} compiled-autograd graph(s), "
            f"{result['graph_breaks']} graph break(s), {result['recompiles']} recompile(s)"
        )
    return "\n".join(lines)
