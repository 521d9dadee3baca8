"""First compiled step against model depth: whole-model compile, per-block compile,
the unsharded model and torch FSDP2, each configuration in a fresh process.

One process on the fake process group (world 2; its collectives move no data, compile
work is the same as on real ranks), the built-in transformer at a small width, CPU.
Every configuration runs in its own subprocess with its own empty
``TORCHINDUCTOR_CACHE_DIR``, so no Dynamo, AOTAutograd or Inductor cache carries over.
A step is forward + loss, backward, optimizer step (SGD). Configurations:

* ``ours-whole``: fsdp_traceable, ``torch.compile(model.loss, fullgraph=True)``,
  backward under compiled autograd (Inductor);
* ``ours-blocks``: fsdp_traceable, ``block.compile(fullgraph=True)`` per block as
  torchtitan does, backward under compiled autograd (Inductor), each block's backward
  one call of a shared region (``fsdp_traceable.backward_regions``);
* ``ours-blocks-traced``: fsdp_traceable, each block wrapped by
  ``torch.compile(block, fullgraph=True)`` after ``fully_shard`` (an ``OptimizedModule``,
  which traces its group's collectives into the block's graph), backward under compiled
  autograd: each block's collectives come from its AOT backward (outlined, the
  collectives outside the shared region), not from tracing the eager hooks around a
  compute-only graph; no eager prefetch between blocks;
* ``ours-blocks-pasted``: the same with ``config.backward_regions = False``: compiled
  autograd pastes every block's backward node by node, as torch does;
* ``ours-blocks-aot``: the same without compiled autograd (each block's AOTAutograd
  backward);
* ``ours-step``: fsdp_traceable, the whole step (forward, loss, backward) as one graph:
  ``fsdp_traceable.compile_step`` (Inductor) with ``config.forward_regions = False``
  (every block traced inline); the optimizer step runs eagerly;
* ``ours-step-regions``: ``ours-step`` with forward regions (the default on torch 2.13+):
  each block's forward one call of a shared nested compile region (traced and compiled
  once; the collectives moved across the region calls for overlap);
* ``ours-step-saved``: the default whole step (forward regions where torch has them)
  with ``compile_step(cache_dir=...)`` (in the cache directory): the first process
  compiles the step ahead of its first call and saves it, a restarted one (``--warm``)
  loads it without compiling;
* ``ours-step-saved-header``: ``ours-step-saved`` loading as torch does, precompiling the
  C++ kernels' header first (without the torch patch ``skip_header_precompile_on_load``):
  the baseline of the load's header skip;
* ``unsharded-whole``: the same model unsharded, whole-model compile + compiled autograd;
* ``unsharded-step``: the same model unsharded, its whole step by ``compile_step``;
* ``fsdp2-blocks``: torch FSDP2 with ``block.compile()`` per block (its hooks run
  eagerly; FSDP2 does not support compiled autograd);
* ``unsharded-regions``: ``unsharded-whole`` with each block's forward marked
  ``torch.compiler.nested_compile_region`` (torch's way to compile a repeated block
  once); it records torch's error where compiled autograd cannot trace the regions.

``--warm`` also reruns each configuration in a second process on the first one's
(now warm) cache directory: a restart's first step against a steady step.
``--warm-empty-tmpdir`` gives that process an empty temporary directory, where Inductor
keeps its precompiled headers: a new container on a kept cache directory.
``--cache-custom-autograd`` and ``--force-backward-lowering`` set the AOTAutograd cache
options that decide whether a forward's cache entry is written (see their help).
``--static-compiled-autograd`` captures compiled autograd's backward with static sizes
(``compiled_autograd._enable(compiler, dynamic=False)``; torch's default makes every
size it collects symbolic): no symbolic-shape reasoning in Dynamo, but a new input
shape captures and compiles the backward again.

Each result records the frames compiled, Dynamo's region traces and stamped-out copies,
the seconds spent in Dynamo, AOTAutograd and Inductor (``compile_phases_s``), per graph
(each frame's compile in the first step and its backend's share, in order: for per-block
compile the blocks' one forward graph, then compiled autograd's backward graph), the
first backward outside those compiles (compiled autograd's capture), and two
counts a loaded machine does not change: the calls Dynamo put into graphs
(``calls_captured``) and, with compiled autograd, the nodes of the backward graph Dynamo
hands Inductor (``compiled_autograd_graph_nodes``; per-block compile adds a fixed number
per block, pinned by ``compile_tests/test_block_compile.py``).

Prints a table and writes JSON (default ``benchmarks/out/compile_time_bench.json``; with
``--publish``, ``benchmarks/results/compile_time_bench.json``)
and, with matplotlib installed (``pip install -e '.[bench]'``), a plot of the first step
against depth next to it (``--replot`` redraws it from the JSON alone).

Run: ``python benchmarks/compile_time_bench.py --layers 4 8 16 32``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ("ours-whole", "ours-blocks", "ours-blocks-traced", "ours-blocks-pasted",
           "ours-blocks-aot", "ours-step", "ours-step-regions", "ours-step-saved",
           "ours-step-saved-header", "unsharded-whole", "unsharded-step", "fsdp2-blocks",
           "unsharded-regions")


def _compile_mode(config: str) -> str:
    """What ``config`` compiles: ``"step"`` (forward, loss and backward as one graph,
    ``compile_step``), ``"whole"`` (the model's loss, backward separately) or
    ``"blocks"`` (each block)."""
    if "-step" in config:
        return "step"
    if config.endswith(("-whole", "-regions")):
        return "whole"
    return "blocks"


def _child(config: str, layers: int, dim: int, steps: int,
           force_backward_lowering: bool = False, static_compiled_autograd: bool = False) -> dict:
    """Runs ``config`` in this (fresh) process; returns its figures."""
    start = time.perf_counter()
    import contextlib
    import statistics

    import torch
    import torch._functorch.config
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import fsdp_traceable
    from fsdp_traceable.introspection.fake_world import fake_process_group
    from fsdp_traceable.models.transformer import (
        Transformer,
        TransformerBlock,
        TransformerConfig,
        shard_transformer,
    )
    from fsdp_traceable.testing import track_compiles

    import_s = time.perf_counter() - start
    torch._functorch.config.force_non_lazy_backward_lowering = force_backward_lowering
    # The fake group's all-gathers leave their outputs uninitialized: denormal garbage in
    # the unsharded parameters would make steady steps arbitrarily slow. The flag is per
    # thread, so compute runs on this one (compile workers are separate processes).
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cfg = TransformerConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, max_seq_len=64)
    with fake_process_group(2):
        torch.manual_seed(0)
        model = Transformer(cfg)
        if config.startswith("ours"):
            shard_transformer(model, fsdp_traceable.fully_shard)
            fsdp_traceable.config.backward_regions = config != "ours-blocks-pasted"
            # ours-step traces every block inline; ours-step-saved keeps the default.
            fsdp_traceable.config.forward_regions = {
                "ours-step": False, "ours-step-regions": True}.get(config)
        elif config.startswith("fsdp2"):
            shard_transformer(model, fsdp2_fully_shard)
        loss_fn = model.loss
        if config == "unsharded-regions":
            # On the class: one region function shared by every block (this process only).
            TransformerBlock.forward = torch.compiler.nested_compile_region(
                TransformerBlock.forward)
        mode = _compile_mode(config)
        if mode == "step":
            def forward_backward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                loss = model.loss(tokens, targets)
                loss.backward()
                return loss.detach()

            cache_dir = None
            if "-saved" in config:
                cache_dir = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "steps")
            if config == "ours-step-saved-header":
                # The load as torch's own (step_cache reads the patch's switch at load).
                fsdp_traceable._torch_patches.header_precompile_skipped = (
                    lambda: contextlib.nullcontext(False))
            loss_fn = fsdp_traceable.compile_step(forward_backward, cache_dir=cache_dir)
        elif mode == "whole":
            loss_fn = torch.compile(model.loss, fullgraph=True)
        elif config == "ours-blocks-traced":
            for index, block in enumerate(model.layers):
                model.layers[index] = torch.compile(block, fullgraph=True)
        else:
            for block in model.layers:
                block.compile(fullgraph=config.startswith("ours"))
        backward_context = contextlib.nullcontext
        backward_backend = None
        if config in ("ours-whole", "ours-blocks", "ours-blocks-traced", "ours-blocks-pasted",
                      "unsharded-whole", "unsharded-regions"):
            # Counting what Dynamo hands Inductor: compiled autograd's graph, whose nodes
            # grow with depth (each block's collectives, region call and gradients).
            backward_backend = CompileCounterWithBackend("inductor")
            compiler = torch.compile(backend=backward_backend, fullgraph=True)

            def backward_context():
                return torch._dynamo.compiled_autograd._enable(
                    compiler, dynamic=not static_compiled_autograd)

        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)

        forward_s: list[float] = []
        backward_s: list[float] = []
        # Per step, the frames compiled by the end of its forward: in the first step,
        # those after it compiled during the backward (compiled autograd's graph, lazy
        # backwards).
        compiles_after_forward: list[int] = []
        timings = torch._dynamo.utils.compilation_time_metrics

        def step() -> float:
            tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=generator)
            t0 = time.perf_counter()
            loss = loss_fn(tokens, torch.roll(tokens, 1, dims=1))
            forward_s.append(time.perf_counter() - t0)
            compiles_after_forward.append(len(timings.get("_compile.compile_inner", [])))
            t1 = time.perf_counter()
            if mode != "step":  # (a whole step ran backward already)
                with backward_context():
                    loss.backward()
            backward_s.append(time.perf_counter() - t1)
            optimizer.step()
            optimizer.zero_grad()
            return time.perf_counter() - t0

        with track_compiles() as record:
            first = step()
            to_first_step_end = time.perf_counter() - start
            first_step_compiles = list(timings.get("_compile.compile_inner", []))
            first_step_backends = list(timings.get("OutputGraph.call_user_compiler", []))
            step()  # warm-up of lazy state
            steady = statistics.median(step() for _ in range(steps))
        # Dynamo's traces and stamped-out copies of nested compile regions (read here:
        # leaving the fake group resets Dynamo, which clears its timings).
        region_traces = {name: len(timings.get(name, []))
                         for name in ("invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out")}
        compile_phases = _compile_phases(timings)
        backward_compiles = first_step_compiles[compiles_after_forward[0]:]
    return {
        "first_step_s": first,
        "first_forward_s": forward_s[0],
        "first_backward_s": backward_s[0],
        # Each frame's compile in the first step, in order (Dynamo's own timing), and
        # the backend's (AOTAutograd + Inductor) share of each frame that has a graph.
        "first_step_frame_compiles_s": [round(t, 2) for t in first_step_compiles],
        "first_step_frame_backends_s": [round(t, 2) for t in first_step_backends],
        # The first backward less the frames it compiled: with compiled autograd, its
        # capture of the autograd graph (and the backward's eager run).
        "first_backward_outside_compiles_s": round(backward_s[0] - sum(backward_compiles), 2),
        "steady_step_s": steady,
        "import_s": import_s,
        "process_to_first_step_end_s": to_first_step_end,
        "step_source": getattr(loss_fn, "source", None),
        "frame_compiles": len(record.frames),
        "frames": sorted(set(f.name for f in record.frames)),
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "calls_captured": counters["stats"].get("calls_captured", 0),
        "compiled_autograd_graph_nodes": (
            [len(g.graph.nodes) for g in backward_backend.graphs]
            if backward_backend is not None else None),
        "graph_breaks": record.graph_breaks.count,
        "region_traces": region_traces,
        "compile_phases_s": compile_phases,
        "recompiles": [f"{f.name}: {f.recompile_reason}" for f in record.recompiles],
        "compiled_autograd_captures": record.compiled_autograd_captures,
        "inductor_cache": {k: v for k, v in counters["inductor"].items()
                           if k.startswith(("fxgraph_cache", "aot_autograd"))},
        "aot_autograd_cache": {k: v for k, v in counters["aot_autograd"].items()
                               if "cache" in k or "hit" in k or "miss" in k},
    }


def _compile_phases(timings: dict[str, list[float]]) -> dict[str, float]:
    """Seconds in Dynamo (tracing, guards: every frame's compile less its backend),
    AOTAutograd (the backend less Inductor) and Inductor (every graph it compiled,
    compiled autograd's and lazily compiled backwards included), from Dynamo's timings."""
    def total(key: str) -> float:
        return sum(timings.get(key, []))

    backend = total("OutputGraph.call_user_compiler")
    inductor = total("compile_fx_inner")
    return {"dynamo": round(total("_compile.compile_inner") - backend, 2),
            "aot_autograd": round(max(backend - inductor, 0.0), 2),
            "inductor": round(inductor, 2)}


def _run(config: str, layers: int, dim: int, steps: int, cache_dir: str,
         cache_custom_autograd: bool = False, force_backward_lowering: bool = False,
         tmpdir: str | None = None, static_compiled_autograd: bool = False) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    if cache_custom_autograd:
        # AOTAutograd's cache refuses graphs holding an autograd.Function unless told
        # they are safe to cache (fully_shard's all-gather is one).
        env["TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD"] = "1"
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    root = pathlib.Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", config, "--layers", str(layers), "--dim", str(dim),
         "--steps", str(steps)] + (["--force-backward-lowering"] if force_backward_lowering else [])
        + (["--static-compiled-autograd"] if static_compiled_autograd else []),
        env=env, capture_output=True, text=True,
    )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": _error_summary(proc.stderr or proc.stdout), "process_wall_s": wall}
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_wall_s"] = wall
    return result


def _error_summary(output: str) -> str:
    """The exception line and Dynamo's explanation, else the output's last lines."""
    lines = [re.sub(r"^\[rank\d+\]:", "", line).strip()
             for line in output.strip().splitlines()]
    picked = [line for line in lines[-60:]
              if re.match(r"^[\w.]+(Error|Exception|Unsupported): ", line)
              or line.startswith("Explanation:")]
    return "\n".join(picked or lines[-8:])


def main() -> None:
    # Here, not at the top: the parent process imports no more than it needs.
    from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="steady steps timed after warm-up")
    parser.add_argument("--warm", action="store_true",
                        help="also rerun each configuration on its warm cache in a new process")
    parser.add_argument("--warm-empty-tmpdir", action="store_true",
                        help="run each warm process with an empty temporary directory")
    parser.add_argument("--cache-custom-autograd", action="store_true",
                        help="let AOTAutograd's cache store graphs with autograd.Functions")
    parser.add_argument("--force-backward-lowering", action="store_true",
                        help="make AOTAutograd compile each backward with its forward "
                             "(torch._functorch.config.force_non_lazy_backward_lowering), "
                             "so its cache entry is written under compiled autograd too")
    parser.add_argument("--static-compiled-autograd", action="store_true",
                        help="capture compiled autograd's backward with static sizes "
                             "(dynamic=False; torch's default is dynamic)")
    add_output_arguments(parser, "compile_time_bench.json")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the plot from the JSON at --out")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = str(output_path(args.out, args.publish, "compile_time_bench.json", ROOT))
    if args.replot:
        print(f"wrote {_plot(json.loads(pathlib.Path(args.out).read_text()), args.out)}")
        return
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.layers[0], args.dim, args.steps,
                                            args.force_backward_lowering,
                                            args.static_compiled_autograd)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            # Configurations interleaved per depth, so a slow phase of a shared machine
            # hits neighbouring figures alike; compare ratios within one run.
            for config in args.configs:
                cache_dir = os.path.join(tmp, f"{config}-{layers}")
                row = {"config": config, "layers": layers, "dim": args.dim,
                       "cold": _run(config, layers, args.dim, args.steps, cache_dir,
                                    args.cache_custom_autograd, args.force_backward_lowering,
                                    static_compiled_autograd=args.static_compiled_autograd)}
                if args.warm and "error" not in row["cold"]:
                    warm_tmp = None
                    if args.warm_empty_tmpdir:
                        warm_tmp = os.path.join(tmp, f"{config}-{layers}-warm-tmp")
                        os.makedirs(warm_tmp)
                    row["warm"] = _run(config, layers, args.dim, args.steps, cache_dir,
                                       args.cache_custom_autograd, args.force_backward_lowering,
                                       warm_tmp, args.static_compiled_autograd)
                rows.append(row)
                cold = row["cold"]
                if "error" in cold:
                    print(f"{config:16s} L={layers:3d}  FAILED: {cold['error']}", flush=True)
                    continue
                warm = row.get("warm", {})
                warm_text = (f"  warm first {warm['first_step_s']:7.2f} s (process start to "
                             f"first step end {warm['process_to_first_step_end_s']:6.2f} s)"
                             if "first_step_s" in warm else "")
                print(f"{config:16s} L={layers:3d}  first {cold['first_step_s']:7.2f} s  "
                      f"steady {cold['steady_step_s'] * 1e3:7.1f} ms  graphs "
                      f"{cold['unique_graphs']:3d}  frames {cold['frame_compiles']:3d}  "
                      f"breaks {cold['graph_breaks']}  calls captured "
                      f"{cold['calls_captured']}  compiled-autograd graph nodes "
                      f"{cold['compiled_autograd_graph_nodes']}  phases "
                      f"{cold['compile_phases_s']}{warm_text}",
                      flush=True)
    summary = _ratios(rows)
    for line in summary["lines"]:
        print(line)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "command": " ".join(sys.argv), "rows": rows, "ratios": summary["ratios"],
        "provenance": provenance(ROOT),
    }
    out = pathlib.Path(args.out)
    write_json(out, report)
    png = _plot(report, args.out)
    if png:
        print(f"wrote {png}")


def _plot(report: dict, json_path: str) -> str | None:
    """Draws each configuration's first step against depth; returns the PNG's path, or
    None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for config in dict.fromkeys(r["config"] for r in report["rows"]):
        points = sorted((r["layers"], r["cold"]["first_step_s"]) for r in report["rows"]
                        if r["config"] == config and "first_step_s" in r["cold"])
        if points:
            ax.plot(*zip(*points), marker="o", label=config)
    depths = sorted({r["layers"] for r in report["rows"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("transformer blocks")
    ax.set_ylabel("first step, empty caches (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"First compiled step against depth ({report['date'][:10]})")
    fig.tight_layout()
    png = str(pathlib.Path(json_path).with_suffix(".png"))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _ratios(rows: list[dict]) -> dict:
    """First-step ratios: each configuration to the unsharded whole-model compile at the
    same depth, and each configuration's growth from its smallest depth."""
    first = {(r["config"], r["layers"]): r["cold"]["first_step_s"]
             for r in rows if "first_step_s" in r["cold"]}
    ratios, lines = {}, []
    depths = sorted({layers for _, layers in first})
    for config in dict.fromkeys(c for c, _ in first):
        mine = {layers: first[(config, layers)] for layers in depths if (config, layers) in first}
        base = min(mine)
        entry = {
            "vs_unsharded_whole": {layers: t / first[("unsharded-whole", layers)]
                                   for layers, t in mine.items()
                                   if ("unsharded-whole", layers) in first},
            f"growth_from_L{base}": {layers: t / mine[base] for layers, t in mine.items()},
        }
        ratios[config] = entry
        lines.append(f"{config:16s} vs unsharded-whole: " + ", ".join(
            f"L={k} {v:.2f}x" for k, v in entry["vs_unsharded_whole"].items())
            + f";  growth from L={base}: " + ", ".join(
            f"L={k} {v:.2f}x" for k, v in entry[f"growth_from_L{base}"].items()))
    return {"ratios": ratios, "lines": lines}


if __name__ == "__main__":
    main()
