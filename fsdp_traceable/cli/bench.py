"""``python -m fsdp_traceable bench``: one workload under torch FSDP2 and fsdp_traceable.

Every mode runs the same model, data and optimizer in the same run on the same ranks,
timed step by step in turn:
torch FSDP2 eager, FSDP2 with per-block ``torch.compile``, fsdp_traceable eager,
whole-model compile, compile + compiled autograd, and the whole step as one graph
(:func:`~fsdp_traceable.compile_step`), then fsdp_traceable's per-block
compile (``block.compile(fullgraph=True)``) with and without compiled autograd; plus
compute-only (unsharded,
no communication) and communication-only (the same collectives, no compute), whose
maximum is the step time perfect overlap would reach.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from ..collectives import foreach_reduce
from ..fsdp import FSDPModule
from ..fsdp import fully_shard as ours_fully_shard
from ..models.transformer import Transformer, shard_transformer
from ..whole_step.capture import dynamo_traces_backward_into_dtensors
from ..whole_step.inductor_options import inductor_options
from .arguments import BENCH_MODES, WHOLE_STEP_MODES
from .launch import launched_by_torchrun, resolve_device, run_on_ranks
from .memory import peak_allocated_bytes
from .progress import say, still_running
from .train import TrainArgs, batch_for, forward_backward_of, make_optimizer, mp_policy_for

MODES = BENCH_MODES
_OURS = ("eager", "compile", "compile-ca", *WHOLE_STEP_MODES, "compile-blocks", "compile-blocks-ca",
         "comm-only")


def default_modes() -> tuple[str, ...]:
    """Every mode of ``MODES`` this torch runs (the whole-step modes need a torch whose
    Dynamo traces ``backward()``: 2.11+)."""
    return tuple(m for m in MODES
                 if m not in WHOLE_STEP_MODES or dynamo_traces_backward_into_dtensors())


def compiled_options(mode: str, with_inductor_options: bool) -> dict | None:
    """The Inductor options our compiled ``mode`` compiles with: with
    ``with_inductor_options``, :func:`~fsdp_traceable.inductor_options` (the whole step
    without raising collectives, which would move each re-gather to the forward's
    start), else none: Inductor's defaults."""
    if not with_inductor_options or mode not in _OURS:
        return None
    return inductor_options(raise_collectives=mode not in WHOLE_STEP_MODES)


def _make_step(mode: str, base: Transformer, args: TrainArgs, mesh: DeviceMesh,
               with_inductor_options: bool):
    """``(step_fn, model)`` for ``mode``; ``step_fn(step)`` runs one training step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = mesh.device_type
    model = copy.deepcopy(base)
    policy = mp_policy_for(args)
    options = compiled_options(mode, with_inductor_options)
    if mode.startswith("fsdp2"):
        shard_transformer(model, fsdp2_fully_shard, mesh=mesh, mp_policy=policy)
        if mode == "fsdp2-compile-blocks":
            for layer in model.layers:
                layer.compile()
    elif mode in _OURS:
        shard_transformer(model, ours_fully_shard, mesh=mesh, mp_policy=policy)
        if mode.startswith("compile-blocks"):
            for layer in model.layers:
                layer.compile(fullgraph=True, options=options)
    elif args.mp == "bf16":  # the unsharded compute-only modes compute in bf16 too
        model.to(torch.bfloat16)
    if mode == "comm-only":
        return _comm_only_step(model, device), model
    optimizer = make_optimizer(args, model.parameters())
    forward_backward = forward_backward_of(
        model, compiled_forward=mode in ("compile", "compile-ca", "compute-only-compiled"),
        compiled_autograd=mode in ("compile-ca", "compile-blocks-ca"),
        whole_step=mode in WHOLE_STEP_MODES,
        optimizer=optimizer if mode == "whole-step-optim" else None, options=options)

    def step_fn(step: int) -> None:
        forward_backward(*batch_for(args, step, rank, world_size, device))
        if mode != "whole-step-optim":  # else the step's graph ran it
            optimizer.step()
            optimizer.zero_grad()

    return step_fn, model


def _comm_only_step(model: Transformer, device: str) -> Callable[[int], None]:
    """The collectives of one eager step, with no compute between them."""
    groups = [m._fsdp_group for m in model.modules() if isinstance(m, FSDPModule)]
    grads = {
        id(g): [torch.zeros(i.global_size, dtype=i.param_dtype, device=device) for i in g.params.infos]
        for g in groups
    }

    def step_fn(step: int) -> None:
        for group in groups:
            group.finish_all_gather(group.start_all_gather())
        for group in reversed(groups):
            if group.settings.reshard_after_forward:
                group.finish_all_gather(group.start_all_gather())
            foreach_reduce(grads[id(group)], group.params.infos, group.params.shard_group)

    return step_fn


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _bench_rank(args: TrainArgs, modes: tuple[str, ...], steps: int, result_path: str,
                with_inductor_options: bool, started: float) -> None:
    """Builds and warms every mode, then times them interleaved: step ``k`` of every
    mode before step ``k + 1`` of any, so slow phases of a shared machine hit all
    modes alike and the ratios hold."""
    device = resolve_device(args.device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    torch.manual_seed(args.seed)
    with torch.device(device):
        base = Transformer(args.config)
    torch._dynamo.reset()
    step_fns, first_steps = {}, {}
    rank_0 = dist.get_rank() == 0
    for i, mode in enumerate(modes):
        compiled = "compile" in mode or mode in WHOLE_STEP_MODES
        if rank_0:
            say(f"mode {i + 1}/{len(modes)} {mode}: two warm-up steps"
                f"{' (the first compiles)' if compiled else ''}", started)
        with (still_running(f"warming up {mode}", started) if rank_0
              else contextlib.nullcontext()):
            step_fn, _ = _make_step(mode, base, args, mesh, with_inductor_options)
            first_steps[mode] = _timed(step_fn, 0, device)
            step_fn(1)  # second warm-up: lazy state, allocator, caches
        step_fns[mode] = step_fn
    if rank_0:
        say(f"timing {steps} steps of each mode, interleaved, then each mode's peak memory",
            started)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for step in range(2, 2 + steps):
        for mode in modes:
            times[mode].append(_timed(step_fns[mode], step, device))
    results = {}
    for mode in modes:
        # Slowest rank decides the step time.
        median = torch.tensor([statistics.median(times[mode])], device=device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        # When gloo's threads free a finished collective's buffers varies and only adds
        # to a step's peak: the least disturbed of 3 steps.
        peak = min(peak_allocated_bytes(lambda: step_fns[mode](3 + steps + i), device)
                   for i in range(3))
        results[mode] = {
            "median_step_ms": median.item() * 1e3,
            "first_step_s": first_steps[mode],
            "peak_bytes": peak,
            "steps": steps,
        }
        if dist.get_rank() == 0:
            print(f"{mode:24s} {median.item() * 1e3:8.1f} ms/step  "
                  f"first {first_steps[mode]:6.2f} s", flush=True)
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)


def _timed(step_fn: Callable[[int], None], step: int, device: str) -> float:
    """Seconds one step takes on this rank, started together on every rank."""
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    step_fn(step)
    _synchronize(device)
    return time.perf_counter() - start


def run_bench(args: TrainArgs, *, steps: int = 10, modes: tuple[str, ...] | None = None,
              with_inductor_options: bool = False, started: float | None = None) -> dict:
    """Runs every mode on the same ranks and returns rank 0's figures.

    Args:
        args: the workload.
        steps: timed steps per mode.
        modes: the modes to run; :func:`default_modes` if ``None``.
        with_inductor_options: compile our modes with
            :func:`~fsdp_traceable.inductor_options` (see :func:`compiled_options`).
        started: when the command started (``time.time()``), the zero of the progress
            lines on standard error; ``None``: now.

    Returns:
        ``{"args": ..., "inductor_options": ..., "modes": {mode: {median_step_ms,
        first_step_s, peak_bytes, ratio_to_fsdp2_eager}}, "overlap_limit_ms": ...}``.
    """
    modes = default_modes() if modes is None else modes
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown bench modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    started = time.time() if started is None else started
    if not launched_by_torchrun():
        say(f"starting {args.world_size} local ranks; each imports torch before it says "
            "more", started)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        # An empty Inductor cache, so first-step times include the whole compile.
        previous_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor_cache")
        try:
            run_on_ranks(_bench_rank, args, modes, steps, path, with_inductor_options, started,
                         world_size=args.world_size, device=args.device)
        finally:
            if previous_cache is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous_cache
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            figures = json.load(f)
    baseline = figures.get("fsdp2-eager", {}).get("median_step_ms")
    for row in figures.values():
        row["ratio_to_fsdp2_eager"] = row["median_step_ms"] / baseline if baseline else None
    report = {"args": asdict(args), "inductor_options": with_inductor_options, "modes": figures}
    limits = {}
    comm = figures.get("comm-only", {}).get("median_step_ms")
    for kind, compute_mode in (("eager", "compute-only"), ("compiled", "compute-only-compiled")):
        compute = figures.get(compute_mode, {}).get("median_step_ms")
        if comm and compute:
            limits[kind] = max(comm, compute)
    report["overlap_limit_ms"] = limits
    return report


def format_table(report: dict) -> str:
    limits = report["overlap_limit_ms"]
    lines = [
        "| mode | median step (ms) | vs FSDP2 eager | vs overlap limit | first step (s) | peak memory (MB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, row in report["modes"].items():
        compiled = mode.startswith(("compile", "whole-step"))
        limit = limits.get("compiled" if compiled else "eager")
        versus_limit = (
            f"{row['median_step_ms'] / limit:.2f}x"
            if limit and mode in _OURS and mode != "comm-only" else ""
        )
        ratio = row.get("ratio_to_fsdp2_eager")
        lines.append(
            f"| {mode} | {row['median_step_ms']:.1f} | {f'{ratio:.2f}x' if ratio else ''} | "
            f"{versus_limit} | {row['first_step_s']:.2f} | {row['peak_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def write_outputs(report: dict, out_dir: str) -> list[str]:
    """Writes ``bench.md``, ``bench.json`` and (with matplotlib) ``bench.png`` to ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "bench.json"), os.path.join(out_dir, "bench.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(format_table(report) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    modes = list(report["modes"])
    values = [report["modes"][m]["median_step_ms"] for m in modes]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(modes, values, color=["#888" if m.startswith("fsdp2") else "#2a7" for m in modes])
    for kind, limit in report["overlap_limit_ms"].items():
        ax.axvline(limit, linestyle="--", color="#c33" if kind == "eager" else "#36c",
                   label=f"overlap limit ({kind})")
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms, lower is better)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bench.png"))
    fig.savefig(paths[-1], dpi=120)
    return paths
