"""Torch's recompute pass for a whole step traced with ``trace_autograd_ops`` refuses two
re-gathered parameters whose ``autograd.Function`` backward reduce-scatters, and
re-gathers nothing for a parameter the forward reads through a view (torch 2.11 to 2.15).

A whole training step compiled as torch documents it (``trace_autograd_ops``, then
``torch.compile(step, fullgraph=True)`` with ``loss.backward()`` inside) is one
forward-loss-backward graph; ``remat_using_tags_for_fwd_loss_bwd_graph`` re-runs the
ops a selective checkpoint tagged must-recompute (here each parameter's all-gather, as
FSDP's reshard-after-forward wants) right before the backward that reads them. It finds
the backward by the ``autograd_backward`` mark on its nodes (2.12 on), and the nodes of a
Dynamo-traced ``autograd.Function``'s backward (the all-gather's, which reduce-scatters)
lose it: AOTAutograd runs that backward's graph through an ``fx.Interpreter``, which
replaces the node meta. With two such parameters the backward that needs a re-gather is
split in two and the pass refuses the graph ("Detected 2 disjoint backward regions that
require recomputation"). And it re-runs tagged nodes only: a backward reading ``t()`` of
the gathered weight (as ``nn.Linear`` does) reads the forward's view, so nothing is
re-gathered and the gathered weight lives from forward to backward. Torch 2.11's pass
finds the backward by an ``fx.traceback.annotate({"remat_pass_tag": "is_backward"})``
annotation instead, which nothing sets for a traced ``loss.backward()``: it re-gathers
nothing in either case. fsdp_traceable completes the pass for graphs holding its own ops
(``_torch_patches.complete_whole_step_recompute``). No fsdp_traceable code is involved:
one process, torch's fake process group of 2 ranks (only the graph matters).

Run: python docs/repros/whole_step_recompute_regions.py
Prints, per case, torch's refusal or the all-gathers in the compiled graph and how many
of them are backward re-gathers. Measured: torch 2.13.0 and 2.15.0: one Function: 2,
1 re-gathered; two Functions: "refused: RuntimeError: Detected 2 disjoint backward
regions that require recomputation, ..."; read through a view: 1, 0 re-gathered.
Torch 2.11.0: 1, 2 and 1 all-gathers, none re-gathered.
"""

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

WORLD = 2
c10d = torch.ops._c10d_functional


class AllGather(torch.autograd.Function):
    """A parameter shard's all-gather; its backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, shard):
        group = dist.group.WORLD.group_name
        return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, WORLD, group))

    @staticmethod
    def backward(ctx, grad):
        group = dist.group.WORLD.group_name
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.contiguous(), "sum", WORLD, group))


def must_recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_all_gather():
    return create_selective_checkpoint_contexts(must_recompute)


def gathered(shard):
    """The full parameter, re-gathered in backward rather than kept (reshard after forward)."""
    return checkpoint(AllGather.apply, shard, use_reentrant=False, context_fn=recompute_all_gather)


def compile_whole_step(shards, read_through_view):
    def step(x):
        for shard in shards:
            weight = gathered(shard)
            x = torch.tanh(x @ (weight.t() if read_through_view else weight))
        loss = x.sum()
        loss.backward()
        return loss.detach()

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=keep, inference_compiler=keep)
    try:
        torch.compile(step, backend=backend, fullgraph=True)(torch.randn(3, 8, requires_grad=True))
    except Exception as error:  # torch's BackendCompilerFailed
        cause = getattr(error, "inner_exception", None) or error
        return f"refused: {type(cause).__name__}: {str(cause).splitlines()[0]}"
    gathers = [n for n in graphs[-1].graph.nodes if "all_gather" in str(n.target)]
    regathered = [n for n in gathers if n.name.endswith("_recomputed")]
    return f"{len(gathers)} all-gather(s), {len(regathered)} re-gathered"


def main():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    torch._dynamo.config.trace_autograd_ops = True
    print("torch", torch.__version__)
    cases = {"one Function (the pass works)": (1, False), "two Functions": (2, False),
             "one Function read through a view": (1, True)}
    for name, (count, read_through_view) in cases.items():
        torch._dynamo.reset()
        shards = [torch.nn.Parameter(torch.randn(4, 8)) for _ in range(count)]
        print(f"{name}:", compile_whole_step(shards, read_through_view))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
