"""What each block adds to compiled autograd's backward under per-block compile, as
counts a loaded machine does not change: the function calls Dynamo inlines while it
traces the backward, and the nodes of the graph it hands its backend.

The built-in transformer at 2 and 4 blocks (width 64 by default), sharded by
``fully_shard``, one process on the fake process group (world 2), every block
``block.compile(fullgraph=True)`` (``aot_eager``), the backward under compiled autograd
with Dynamo alone (the ``eager`` backend: what Dynamo traces does not depend on the
backend). A block's share is the difference between the two depths, halved. Inlined
calls are Dynamo's ``InliningInstructionTranslator.inline_call_``, counted while the
backward runs (the blocks' forward compiles before it), and listed per inlined function
where a block adds any. Also timed (wall seconds, which load moves; compare within a
run): the backward (compiled autograd's capture and Dynamo's trace) and, within it,
Dynamo's time in each outermost inlined call by function (compiled autograd's
``call_hook``, ``call_backward``, ...: the eager hooks' share, everything they inline
included). About a minute on one core.

Run: ``python benchmarks/block_trace_count.py`` (prints the counts and writes them as JSON,
``--out PATH`` or ``--publish``, as every benchmark script).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[1]


def count(n_layers: int, dim: int) -> dict:
    """One step of the ``n_layers``-block model; returns its backward's counts."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import fsdp_traceable
    from fsdp_traceable.introspection.fake_world import fake_process_group
    from fsdp_traceable.introspection.inlined_calls import count_inlined_calls
    from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer

    cfg = TransformerConfig(vocab_size=96, dim=dim, n_layers=n_layers, n_heads=4,
                            hidden_dim=dim + dim // 2, max_seq_len=12)
    with fake_process_group(2):
        torch.manual_seed(0)
        model = shard_transformer(Transformer(cfg), fsdp_traceable.fully_shard)
        for block in model.layers:
            block.compile(backend="aot_eager", fullgraph=True)
        backend = CompileCounterWithBackend("eager")
        compiler = torch.compile(backend=backend, fullgraph=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len),
                               generator=torch.Generator().manual_seed(1))
        loss = model.loss(tokens, torch.roll(tokens, 1, dims=1))
        captured_before = counters["stats"].get("calls_captured", 0)
        outermost: Counter[str] = Counter()
        start = time.perf_counter()
        with (count_inlined_calls(outermost) as inlined,
              torch._dynamo.compiled_autograd._enable(compiler)):
            loss.backward()
        backward_s = time.perf_counter() - start
        captured = counters["stats"].get("calls_captured", 0) - captured_before
        (graph,) = backend.graphs
        nodes = len(graph.graph.nodes)
    return {"layers": n_layers, "graph_nodes": nodes, "calls_captured": captured,
            "inlined_calls": sum(inlined.values()), "inlined": dict(inlined),
            "backward_s": backward_s, "outermost_inlined_s": dict(outermost)}


def per_block(small: dict, large: dict) -> dict:
    """What one block adds, from the counts at two depths."""
    blocks = large["layers"] - small["layers"]

    def share(key: str) -> float:
        return (large[key] - small[key]) / blocks

    def share_by_name(key: str) -> dict[str, float]:
        return {name: (large[key].get(name, 0) - small[key].get(name, 0)) / blocks
                for name in set(small[key]) | set(large[key])}

    by_function, seconds = share_by_name("inlined"), share_by_name("outermost_inlined_s")
    return {
        "backward_s": share("backward_s"),
        "outermost_inlined_s": dict(sorted(((k, round(v, 4)) for k, v in seconds.items()
                                            if v > 0.0005), key=lambda item: -item[1])),
        "graph_nodes": share("graph_nodes"),
        "calls_captured": share("calls_captured"),
        "inlined_calls": share("inlined_calls"),
        "inlined": dict(sorted(((k, v) for k, v in by_function.items() if v),
                               key=lambda item: (-item[1], item[0]))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    parser.add_argument("--dim", type=int, default=64)
    sys.path.insert(0, str(ROOT))
    from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance, write_json

    add_output_arguments(parser, "block_trace_count.json")
    args = parser.parse_args()
    small, large = (count(n, args.dim) for n in args.layers)
    block = per_block(small, large)
    for result in (small, large):
        print(f"L={result['layers']}: graph nodes {result['graph_nodes']}, calls captured "
              f"{result['calls_captured']}, inlined calls {result['inlined_calls']}")
    print(f"per block: graph nodes {block['graph_nodes']:g}, calls captured "
          f"{block['calls_captured']:g}, inlined calls {block['inlined_calls']:g}")
    for name, n in block["inlined"].items():
        print(f"  {n:6g}  {name}")
    print(f"per block: backward {block['backward_s']:.3f} s (capture and Dynamo; wall time, "
          "moves with load), of which in the outermost inlined calls:")
    for name, seconds in block["outermost_inlined_s"].items():
        print(f"  {seconds:.4f} s  {name}")
    import torch

    report = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
              "dim": args.dim, "depths": [small, large], "per_block": block,
              "provenance": provenance(ROOT)}
    path = output_path(args.out, args.publish, "block_trace_count.json", ROOT)
    write_json(path, report)


if __name__ == "__main__":
    main()
