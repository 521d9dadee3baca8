"""The plan of pipeline parallel, HSDP and CPU offload against the real step on 4 gloo
ranks (one launch for all three): the built-in transformer cut into 2 pipeline stages
of a (pp 2, dp 2) mesh and driven by ``Schedule1F1B`` (each stage's sharded bytes,
collectives and sends and receives), and the whole transformer on a (replicate 2,
shard 2) mesh with ``CPUOffloadPolicy`` (its all-gathers, reduce-scatters and the
all-reduce across replicas)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_traceable import fully_shard
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, TransformerStage
from fsdp_traceable.plan.extrapolate import HOST_CATEGORIES, make_plan, stage_plan
from fsdp_traceable.plan.models import ShardSettings, model_source
from fsdp_traceable.plan.trace import Workload
from fsdp_traceable.testing.local_ranks import run_on_local_ranks

CONFIG = TransformerConfig(vocab_size=256, dim=32, n_layers=10, n_heads=4, max_seq_len=16)
WORKLOAD = Workload(batch_size=4, seq_len=16)
MICROBATCHES = 2
_C10D = {"c10d._allgather_base_": "all-gather", "c10d._reduce_scatter_base_": "reduce-scatter",
         "c10d.allreduce_": "all-reduce", "c10d.send": "send", "c10d.recv_": "recv"}


class _Collectives(TorchDispatchMode):
    """(kind, group size) -> [count, bytes] of every c10d collective and send/recv."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, int], list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.replace("::", ".")
        if name in _C10D:
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a])
                       if isinstance(t, torch.Tensor)]
            size = next(dist.ProcessGroup.unbox(a).size() for a in args
                        if isinstance(a, torch._C.ScriptObject))
            entry = self.seen.setdefault((_C10D[name], size), [0, 0])
            entry[0] += 1
            entry[1] += max(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {"params": sum(local(p).untyped_storage().nbytes() for p in model.parameters()),
            "optimizer": sum(local(v).untyped_storage().nbytes() for v in state)}


def _recorded_second_step(step) -> dict:
    step()  # the optimizer state
    counter = _Collectives()
    with counter:
        grads = step()
    return {"collectives": counter.seen, "gradients": grads}


def _pipeline_step(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    stage_index = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    stage_module = TransformerStage(Transformer(CONFIG), stage_index, 2)
    for block in stage_module.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, stage_index, 2, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=lambda out, t: (
        F.cross_entropy(out.flatten(0, 1), t.flatten())))
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, CONFIG.vocab_size, (WORKLOAD.batch_size, WORKLOAD.seq_len))

    def step() -> int:
        if stage.is_first:
            schedule.step(tokens)
        else:
            schedule.step(target=tokens, losses=[])
        grads = sum(p.grad.to_local().nbytes for p in stage_module.parameters())
        optimizer.step()
        optimizer.zero_grad()
        return grads

    return {"stage": stage_index, **_recorded_second_step(step),
            **_state_bytes(stage_module, optimizer)}


def _hsdp_offload_step(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, CONFIG.vocab_size, (WORKLOAD.batch_size, WORKLOAD.seq_len))

    def step() -> int:
        model.loss(tokens, tokens).backward()
        grads = sum(p.grad.to_local().nbytes for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        return grads

    return {**_recorded_second_step(step), **_state_bytes(model, optimizer)}


def _both(rank: int, world_size: int) -> dict:
    return {"pipeline": _pipeline_step(rank, world_size),
            "hsdp": _hsdp_offload_step(rank, world_size)}


@pytest.fixture(scope="module")
def real() -> list[dict]:
    return run_on_local_ranks(_both, 4)


def _source():
    return model_source("transformer", layers=CONFIG.n_layers, dim=CONFIG.dim,
                        heads=CONFIG.n_heads, vocab_size=CONFIG.vocab_size,
                        seq_len=CONFIG.max_seq_len)


def _by_kind_and_size(plan) -> dict[tuple[str, int], list[int]]:
    seen: dict[tuple[str, int], list[int]] = {}
    for (kind, _, _, ranks), (count, nbytes) in plan.collectives.items():
        entry = seen.setdefault((kind, ranks), [0, 0])
        entry[0] += count
        entry[1] += nbytes
    return seen


@pytest.fixture(scope="module")
def pipeline_plan():
    """Each stage's 5 blocks extrapolated from 3 and 4."""
    settings = ShardSettings(param_dtype="fp32", pp=2, microbatches=MICROBATCHES)
    return make_plan(_source(), 4, settings, WORKLOAD)


@pytest.mark.gloo
def test_each_pipeline_stage_is_planned_as_the_real_one(real: list[dict], pipeline_plan) -> None:
    assert [p.stage_index for p in pipeline_plan.stages] == [0, 1]
    assert pipeline_plan in pipeline_plan.stages
    for plan in pipeline_plan.stages:
        assert plan.traced_depths == (3, 4) and plan.depth == 5
        measured = real[2 * plan.stage_index]["pipeline"]  # the stage's first rank
        assert measured["stage"] == plan.stage_index
        assert (plan.params_bytes, plan.optimizer_bytes, plan.gradient_bytes) == (
            measured["params"], measured["optimizer"], measured["gradients"])
        # Every all-gather, reduce-scatter, send and receive: count, group size, bytes.
        assert _by_kind_and_size(plan) == measured["collectives"], plan.stage_index
        assert measured["collectives"][("send", 2)][0] == MICROBATCHES


def test_a_stage_extrapolated_from_three_and_four_blocks_is_its_full_trace(pipeline_plan):
    settings = ShardSettings(param_dtype="fp32", pp=2, microbatches=MICROBATCHES)
    full = stage_plan(_source(), 0, 4, settings, WORKLOAD, full_trace=True)
    ours = pipeline_plan.stages[0]
    assert full.traced_depths == (5,) and ours.stage_index == 0
    for name in ("phase_peaks", "at_peak", "peak_phase", "flops", "most_activations"):
        assert getattr(ours, name) == getattr(full, name), name


@pytest.mark.gloo
def test_hsdp_with_cpu_offload_is_planned_as_the_real_step(real: list[dict]) -> None:
    settings = ShardSettings(param_dtype="fp32", dp_replicate=2, offload=True)
    plan = make_plan(_source(), 4, settings, WORKLOAD)
    measured = real[0]["hsdp"]
    assert (plan.params_bytes, plan.optimizer_bytes, plan.gradient_bytes) == (
        measured["params"], measured["optimizer"], measured["gradients"])
    assert _by_kind_and_size(plan) == measured["collectives"]
    # Gathered and reduced within a replica (2 ranks), all-reduced across replicas, each
    # by its fully_shard group (the last ones finish at the end of backward).
    assert {kind for kind, _ in measured["collectives"]} == {
        "all-gather", "reduce-scatter", "all-reduce"}
    assert {group for kind, group, _, _ in plan.collectives if kind == "all-reduce"} == {
        "(root)", "layers.*"}
    # Offloaded: the sharded state is off the device peak.
    assert plan.offload and not set(plan.at_peak) & HOST_CATEGORIES

