"""``torch.compile`` backends that keep the graphs they compile, for tests and
:func:`fsdp_traceable.introspection.explain.explain`.

:class:`GraphCapture` stops after AOTAutograd (Inductor's decompositions and
partitioner, no Inductor codegen): fast, for checking graph content.
:class:`InductorCapture` runs the full Inductor pipeline and keeps every stage:
Dynamo's graph, AOTAutograd's forward / backward / inference graph, the graph after
Inductor's post-grad passes, and the generated code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from .graph import CollectiveNode, collective_nodes, collective_sequence

__all__ = ["CapturedGraph", "InductorCapture", "OutputCode"]


@dataclass
class CapturedGraph:
    """One graph a compile produced, summarized when it was captured (later passes may
    rewrite the graph object in place).

    ``stage``: ``"dynamo"``, ``"aot_forward"``, ``"aot_backward"``, ``"aot_inference"``
    or ``"post_grad_<forward|backward|inference>"``. ``compile_id``: Dynamo's id of the
    frame compile it came from (``"?"`` when compiled outside one, e.g. a lazily
    compiled backward). ``code``: the readable graph code. ``collectives`` and
    ``sequence``: see :mod:`fsdp_traceable.introspection.graph`.
    """

    stage: str
    compile_id: str
    code: str
    node_count: int
    collectives: list[CollectiveNode] = field(default_factory=list)
    sequence: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, stage: str, gm: torch.fx.GraphModule) -> CapturedGraph:
        """Summarizes ``gm`` now."""
        return cls(stage, _compile_id(), _readable(gm), len(gm.graph.nodes),
                   collective_nodes(gm), collective_sequence(gm))


@dataclass
class OutputCode:
    """The Python wrapper code Inductor generated for one AOTAutograd graph."""

    stage: str
    compile_id: str
    code: str


def _compile_id() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else "?"


def _readable(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


class InductorCapture:
    """A ``torch.compile`` backend that compiles with Inductor and keeps every stage.

    Args:
        inductor: ``False`` stops after AOTAutograd (the ``aot_eager`` pipeline with
            Inductor's decompositions): no post-grad graphs or generated code.
    """

    def __init__(self, *, inductor: bool = True) -> None:
        self.inductor = inductor
        self.graphs: list[CapturedGraph] = []
        self.output_code: list[OutputCode] = []
        # The latest AOTAutograd graph module of each stage (Inductor's post-grad
        # passes later rewrite it in place).
        self.graph_modules: dict[str, torch.fx.GraphModule] = {}

    @property
    def forward(self) -> torch.fx.GraphModule | None:
        """The latest AOTAutograd forward graph module."""
        return self.graph_modules.get("aot_forward")

    @property
    def backward(self) -> torch.fx.GraphModule | None:
        """The latest AOTAutograd backward graph module (kept once backward first runs)."""
        return self.graph_modules.get("aot_backward")

    def _keep(self, stage: str, gm: torch.fx.GraphModule) -> None:
        self.graphs.append(CapturedGraph.of(stage, gm))
        self.graph_modules[stage] = gm

    def graphs_of(self, stage: str) -> list[CapturedGraph]:
        """The captured graphs of one stage, in compile order."""
        return [g for g in self.graphs if g.stage == stage]

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The Dynamo backend: pass as ``torch.compile(..., backend=capture.backend)``."""
        self.graphs.append(CapturedGraph.of("dynamo", gm))
        if not self.inductor:
            return aot_autograd(
                fw_compiler=self._aot_eager("aot_forward"),
                bw_compiler=self._aot_eager("aot_backward"),
                inference_compiler=self._aot_eager("aot_inference"),
                partition_fn=min_cut_rematerialization_partition,
                decompositions=select_decomp_table(),
            )(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=self._inner_compile)

    def _aot_eager(self, stage: str) -> Callable[..., Any]:
        from functorch.compile import make_boxed_func

        def compiler(gm: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
            self._keep(stage, gm)
            return make_boxed_func(gm.forward)

        return compiler

    def _inner_compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        compile_id = _compile_id()
        self._keep(f"aot_{kind}", gm)
        codes: list[str] = []
        with _saving_output_code(codes.append):
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        # Inductor's post-grad passes rewrote ``gm`` in place during the compile.
        self.graphs.append(CapturedGraph.of(f"post_grad_{kind}", gm))
        for code in codes:
            self.output_code.append(OutputCode(kind, compile_id, code))
        return compiled


@contextlib.contextmanager
def _saving_output_code(save: Callable[[str], None]) -> Iterator[None]:
    from torch._inductor.graph import GraphLowering

    with mock.patch.object(GraphLowering, "save_output_code", save):
        yield
