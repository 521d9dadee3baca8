"""Every ``nested_compile_region`` call that needs a gradient traces the region's graph
again to build its schema (torch 2.11 to 2.15).

Under AOTAutograd each such call passes ``HigherOrderOperator``'s autograd entry, which
builds the call's schema with ``InvokeSubgraphHOP.gen_schema`` (to refuse in-place input
mutation), and that traces the region's whole graph again (``materialize_as_graph``):
once per call and AOTAutograd pass, although every call of one region with one argument
layout gets the same schema (measured with fsdp_traceable's 16-block whole step,
``aot_eager``: AOTAutograd 7.5 s, 5.9 s with the schemas kept). fsdp_traceable keeps the
schema of its own reused regions per graph and argument layout
(``_torch_patches.memoize_region_schemas``). No fsdp_traceable code is involved.

Run: python docs/repros/region_schema_retrace.py
Prints the calls, the schemas built, how many distinct, and the region re-traces
(torch 2.13: 3 calls, 7 schemas, 2 distinct, 14 re-traces).
"""

import torch
from torch._higher_order_ops import utils as hop_utils
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

traces, schemas = [], []
materialize = hop_utils.materialize_as_graph
gen_schema = InvokeSubgraphHOP.gen_schema
hop_utils.materialize_as_graph = lambda *a, **k: traces.append(1) or materialize(*a, **k)
InvokeSubgraphHOP.gen_schema = lambda *a: schemas.append(str(gen_schema(*a))) or gen_schema(*a)


@torch.compiler.nested_compile_region
def block(x, weight):
    return torch.tanh(x @ weight)


def loss(x, weights):
    for weight in weights:
        x = block(x, weight)
    return x.sum()


weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
torch.compile(loss, backend="aot_eager", fullgraph=True)(torch.randn(4, 8), weights).backward()
print(f"3 calls, {len(schemas)} schemas, {len(set(schemas))} distinct, {len(traces)} re-traces")
