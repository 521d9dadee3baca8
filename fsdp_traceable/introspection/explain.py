"""``explain``: what ``torch.compile`` makes of a ``fully_shard``-ed model's train step.

Runs a few train steps on a single process (a fake process group stands in for the
ranks unless one is already initialized), compiling the forward + loss with
``torch.compile`` and the backward with compiled autograd, and reports the graphs,
graph breaks and recompiles (with Dynamo's reasons), the collectives of every graph
with their sizes, which Inductor kernels copy into and out of each collective, and the
compute Inductor issued between each collective and its wait. ``whole_step=True``
compiles forward, loss and backward as one graph instead (:func:`~fsdp_traceable.compile_step`).
With ``out_dir`` it also writes every graph and the generated code as files, like
``TORCH_LOGS="graph_code,aot_graphs,post_grad_graphs,output_code"`` would log them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._functorch import config as functorch_config

from ..fsdp import FSDPModule, fully_shard
from ..models.transformer import Transformer, TransformerConfig, shard_transformer
from ..whole_step.capture import compile_step
from .capture import CapturedGraph, InductorCapture, OutputCode
from .compiles import FrameCompile, GraphBreaks, track_compiles
from .fake_world import fake_process_group
from .inductor_code import CollectiveCopies, CollectiveOverlap, collective_copies, overlap

__all__ = ["DEMO_CONFIG", "Report", "explain"]

DEMO_CONFIG = TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32)


@dataclass
class Report:
    """What :func:`explain` found; ``str(report)`` is a readable summary.

    ``graphs``: every captured graph (Dynamo, AOTAutograd, post-grad), in compile
    order. ``output_code``: Inductor's generated code per AOTAutograd graph.
    ``copies``: per generated code, each collective with its copy-in and copy-out
    kernels. ``overlaps``: per generated code, each collective with the compute issued
    between its start and its wait. ``files``: the dumps written to ``out_dir``.
    """

    world_size: int
    steps: int
    compiled_autograd: bool
    inductor: bool
    inductor_config: dict[str, object]
    frames: list[FrameCompile]
    graph_breaks: GraphBreaks
    compiled_autograd_captures: int
    graphs: list[CapturedGraph]
    output_code: list[OutputCode]
    copies: list[tuple[OutputCode, list[CollectiveCopies]]]
    overlaps: list[tuple[OutputCode, list[CollectiveOverlap]]] = field(default_factory=list)
    whole_step: bool = False
    files: list[Path] = field(default_factory=list)

    @property
    def recompiles(self) -> list[FrameCompile]:
        """The frame compiles that were recompiles."""
        return [frame for frame in self.frames if frame.is_recompile]

    def graphs_of(self, stage: str) -> list[CapturedGraph]:
        """The captured graphs of one stage (e.g. ``"dynamo"``, ``"aot_forward"``)."""
        return [graph for graph in self.graphs if graph.stage == stage]

    def __str__(self) -> str:
        backward = ("whole step as one graph" if self.whole_step else
                    f"compiled autograd {'on' if self.compiled_autograd else 'off'}")
        lines = [
            f"fsdp_traceable explain: {self.world_size} ranks, {self.steps} steps, {backward}, "
            f"{'inductor' if self.inductor else 'aot_eager'}",
        ]
        if self.inductor_config:
            lines.append("Inductor config: " + ", ".join(
                f"{name}={value!r}" for name, value in self.inductor_config.items()))
        lines += [
            "",
            f"Frames compiled: {len(self.frames)} (recompiles: {len(self.recompiles)})",
        ]
        for frame in self.frames:
            # Compile ids of frames compiled while compiled autograd runs start with "!".
            what = " (compiled autograd backward graph)" if frame.compile_id.startswith("!") else ""
            lines.append(f"  [{frame.compile_id}] {frame.name}{what}")
        for frame in self.recompiles:
            lines.append(f"  recompile of {frame.name} [{frame.compile_id}]: "
                         f"{_first_line(frame.recompile_reason)}")
        if self.compiled_autograd:
            lines.append(f"Compiled autograd: {self.compiled_autograd_captures} backward "
                         "graph(s) captured")
        lines.append(f"Graph breaks: {self.graph_breaks.count}")
        for i, reason in enumerate(self.graph_breaks.summaries()):
            where = self.graph_breaks.locations[i] if i < len(self.graph_breaks.locations) else ""
            lines.append(f"  {reason}" + (f" ({where})" if where else ""))
        lines += ["", "Graphs (collectives: kind x count, bytes in -> out):"]
        for graph in self.graphs:
            lines.append(f"  {graph.stage:22s} [{graph.compile_id}] {graph.node_count:5d} nodes"
                         f"  {_collective_summary(graph)}")
        if self.copies:
            lines += ["", "Inductor copy kernels per collective (copy-in | copy-out):"]
        for output, copies in self.copies:
            lines.append(f"  {output.stage} [{output.compile_id}]:")
            for copy in copies:
                lines.append(f"    {copy.kind:14s} in: {_kernels(copy.copy_in)} | "
                             f"out: {_kernels(copy.copy_out)}")
        if self.overlaps:
            lines += ["", "Compute between each collective's start and its wait:"]
        for output, overlaps in self.overlaps:
            lines.append(f"  {output.stage} [{output.compile_id}]:")
            for entry in overlaps:
                waited = _kernels(entry.compute) if entry.waited else "never waited"
                lines.append(f"    {entry.kind:14s} line {entry.line:4d}: {waited}")
        if self.files:
            lines += ["", f"Wrote {len(self.files)} files to {self.files[0].parent}"]
        return "\n".join(lines)


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _kernels(names: list[str]) -> str:
    if not names:
        return "-"
    counts = list(Counter(names).items())
    shown = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts[:2])
    more = f", +{len(counts) - 2} more" if len(counts) > 2 else ""
    return f"{len(names)} kernel{'s' if len(names) != 1 else ''} ({shown}{more})"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _collective_summary(graph: CapturedGraph) -> str:
    if not graph.collectives:
        return "-"
    groups: dict[tuple[str, tuple[str, ...]], list] = {}
    for node in graph.collectives:
        groups.setdefault((node.kind, node.path), []).append(node)
    parts = []
    for (kind, path), nodes in groups.items():
        where = f" in {'/'.join(path)}" if path else ""
        size_in = sum(n.input_bytes for n in nodes)
        size_out = sum(n.output_bytes for n in nodes)
        parts.append(f"{kind} x{len(nodes)}{where} ({_bytes(size_in)} -> {_bytes(size_out)})")
    return "; ".join(parts)


def explain(
    model: nn.Module | None = None,
    *,
    world_size: int = 2,
    out_dir: str | Path | None = None,
    steps: int = 2,
    compiled_autograd: bool = True,
    inputs: Sequence[Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    inductor: bool = True,
    config: TransformerConfig | None = None,
    inductor_config: Mapping[str, object] | None = None,
    whole_step: bool = False,
) -> Report:
    """Compiles ``steps`` train steps of a ``fully_shard``-ed model and reports the result.

    Resets Dynamo's caches first, so every compile is counted. Without an initialized
    process group, a fake one of ``world_size`` ranks stands in for the ranks (its
    collectives move no data) and is destroyed afterwards.

    Args:
        model: the model; ``None`` builds the built-in demo :class:`Transformer`
            (``config``). A model not yet sharded is sharded with
            :func:`fsdp_traceable.fully_shard`: a :class:`Transformer` per block and
            then at the root, any other module as one group.
        world_size: ranks of the fake process group.
        out_dir: where to write the graph and code dumps (``None``: write nothing).
        steps: train steps to run (the second and later show recompiles, if any).
        compiled_autograd: compile the backward with compiled autograd; ``False``
            uses AOTAutograd's backward graph.
        inputs: the model's positional inputs; required unless the model is a
            :class:`Transformer`, which gets random tokens.
        loss_fn: ``loss_fn(model, *inputs) -> scalar``; default ``model.loss(*inputs)``
            for a :class:`Transformer`, else the sum of ``model(*inputs)``.
        inductor: compile with Inductor (post-grad graphs, generated code, copy
            kernels); ``False`` stops after AOTAutograd (faster).
        config: the demo transformer's configuration (``model=None`` only).
        inductor_config: Inductor settings for every compile, e.g.
            :func:`fsdp_traceable.inductor_options` (default: Inductor's own).
        whole_step: compile forward, loss and backward as one graph with
            :func:`fsdp_traceable.compile_step` (torch 2.11+); ``compiled_autograd``
            must then be ``False``.

    Returns:
        The :class:`Report`.
    """
    _check_args(model, world_size, steps, inputs, loss_fn, config)
    if whole_step and compiled_autograd:
        raise ValueError("whole_step=True compiles the backward into the step's one graph: "
                         "pass compiled_autograd=False with it")
    ranks = (contextlib.nullcontext() if dist.is_initialized()
             else fake_process_group(world_size, reset_dynamo=False))
    with ranks:
        model, inputs, loss_fn = _prepare(model, inputs, loss_fn, config)
        return _run(model, inputs, loss_fn, steps=steps, compiled_autograd=compiled_autograd,
                    inductor=inductor, out_dir=out_dir, inductor_config=dict(inductor_config or {}),
                    whole_step=whole_step)


def _check_args(model, world_size, steps, inputs, loss_fn, config) -> None:
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if model is not None and not isinstance(model, Transformer) and inputs is None:
        raise ValueError(
            f"inputs is required for a {type(model).__name__}: pass the model's positional "
            "inputs (only the built-in Transformer gets random tokens)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if config is not None and model is not None:
        raise ValueError("config configures the demo model: pass either model or config")


def _prepare(model, inputs, loss_fn, config):
    if model is None:
        torch.manual_seed(0)
        model = Transformer(config or DEMO_CONFIG)
    if not isinstance(model, FSDPModule):
        if isinstance(model, Transformer):
            shard_transformer(model, fully_shard)
        else:
            fully_shard(model)
    if inputs is None:
        cfg = model.config
        tokens = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.max_seq_len)))
        inputs = (tokens, torch.roll(tokens, 1, dims=1))
    if loss_fn is None:
        if isinstance(model, Transformer):
            def loss_fn(m, *args):
                return m.loss(*args)
        else:
            def loss_fn(m, *args):
                out = m(*args)
                tensors = out if isinstance(out, (list, tuple)) else [out]
                return sum(t.float().sum() for t in tensors if isinstance(t, torch.Tensor))
    return model, tuple(inputs), loss_fn


def _run(model, inputs, loss_fn, *, steps, compiled_autograd, inductor, out_dir,
         inductor_config, whole_step) -> Report:
    torch._dynamo.reset()
    capture = InductorCapture(inductor=inductor)

    def forward_loss(*args):
        return loss_fn(model, *args)

    def forward_loss_backward(*args):
        loss = loss_fn(model, *args)
        loss.backward()
        return loss.detach()

    if whole_step:
        compiled = compile_step(forward_loss_backward, backend=capture.backend)
    else:
        compiled = torch.compile(forward_loss, backend=capture.backend)
    backward_compiler = torch.compile(backend=capture.backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Every graph compiled, none loaded from a cache (a cached graph has no graph or code
    # to keep): the FX graph and AOTAutograd caches off for this call, not
    # force_disable_caches, which makes Dynamo warn that it turned its profile-guided
    # dynamic shapes off too.
    with (torch._inductor.config.patch(**{"fx_graph_cache": False,
                                          "fx_graph_remote_cache": False, **inductor_config}),
          functorch_config.patch(enable_autograd_cache=False,
                                 enable_remote_autograd_cache=False),
          track_compiles() as record):
        for _ in range(steps):
            loss = compiled(*inputs)
            if not whole_step:
                backward = (torch._dynamo.compiled_autograd._enable(backward_compiler)
                            if compiled_autograd else contextlib.nullcontext())
                with backward:
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    report = Report(
        world_size=dist.get_world_size(),
        steps=steps,
        compiled_autograd=compiled_autograd,
        inductor=inductor,
        inductor_config=inductor_config,
        frames=record.frames,
        graph_breaks=record.graph_breaks,
        compiled_autograd_captures=record.compiled_autograd_captures,
        graphs=list(capture.graphs),
        output_code=list(capture.output_code),
        copies=[(code, collective_copies(code.code)) for code in capture.output_code],
        overlaps=[(code, overlap(code.code)) for code in capture.output_code],
        whole_step=whole_step,
    )
    if out_dir is not None:
        report.files = _write(report, Path(out_dir))
    return report


def _write(report: Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    per_stage: Counter = Counter()
    for graph in report.graphs:
        name = f"{graph.stage}_graph_{per_stage[graph.stage]}.py"
        per_stage[graph.stage] += 1
        header = f"# {graph.stage} graph, compile id {graph.compile_id}\n"
        if graph.sequence:
            header += "# collectives:\n" + "".join(f"#   {line}\n" for line in graph.sequence)
        files.append(out_dir / name)
        files[-1].write_text(header + graph.code)
    for i, code in enumerate(report.output_code):
        files.append(out_dir / f"output_code_{i}_{code.stage}.py")
        files[-1].write_text(f"# Inductor output code ({code.stage}), compile id "
                             f"{code.compile_id}\n{code.code}")
    files.append(out_dir / "report.txt")
    report.files = files
    files[-1].write_text(str(report) + "\n")
    return files
