"""Bad calls to ``fully_shard`` and to a sharded model, and the tables of ``docs/errors.md``.

Each case is ``name -> (exception type, regex the message must match, call(mesh, shard))``,
the format of ``BAD_CALLS`` in ``test_fully_shard_features`` (whose cases are reused,
not repeated, here): ``shard`` is the ``fully_shard`` under test, ours or FSDP2's, so
each case also runs on FSDP2 and ``docs/errors.md`` shows what FSDP2 raises next to
ours. ``python -m tests.fsdp.bad_input_cases`` prints the ``docs/errors.md`` tables of
every case, these and the foreach collectives' cases of ``test_validation``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import Shard

import fsdp_traceable
from fsdp_traceable import (
    foreach_all_gather,
    foreach_reduce,
    fully_shard,
    make_shard_info,
)
from fsdp_traceable.fsdp.arguments import (
    ArgumentTypeError,
    EmptyModuleListError,
    ShardingOrderError,
)
from fsdp_traceable.introspection.fake_world import fake_process_group

FullyShard = Callable[..., Any]  # a fully_shard: ours or FSDP2's
BadCall = tuple[type[Exception], str, Callable[[DeviceMesh, FullyShard], object]]


class _WithParam(nn.Module):
    """A linear layer plus one extra parameter ``extra`` used in forward."""

    def __init__(self, extra: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Parameter(extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.extra


def _mixed_dtypes() -> nn.Module:
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    module[1].to(torch.bfloat16)
    return module


def _root_then_child(mesh: DeviceMesh, shard: FullyShard) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shard(model, mesh=mesh)
    shard(model[0], mesh=mesh)


def _tied_across_groups(mesh: DeviceMesh, shard: FullyShard) -> None:
    """Both accept the second call and raise in the first forward (its root's)."""
    model = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    shard(model[1], mesh=mesh)
    shard(model, mesh=mesh)
    model(torch.arange(2))


def _sharded_linear(mesh: DeviceMesh, shard: FullyShard) -> nn.Module:
    return shard(nn.Linear(4, 4), mesh=mesh)


def _ignore_one_parameter(mesh: DeviceMesh, shard: FullyShard) -> None:
    module = nn.Linear(4, 4)
    shard(module, mesh=mesh, ignored_params=module.weight)


def _meta(*size: int) -> torch.Tensor:
    return torch.zeros(*size, device="meta")


def _policy(**kwargs: object) -> Callable[[DeviceMesh, FullyShard], object]:
    return lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh,
                                     mp_policy=MixedPrecisionPolicy(**kwargs))


def _placement(dim: int) -> Callable[[DeviceMesh, FullyShard], object]:
    return lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh,
                                     shard_placement_fn=lambda p: Shard(dim))


def _bucket_over_limit(mesh: DeviceMesh, shard: FullyShard) -> None:
    with fsdp_traceable.config.patch(max_bucket_bytes=1000):  # Linear(16, 16) is 1088 bytes
        shard(nn.Linear(16, 16), mesh=mesh)


def _column_major_weight() -> nn.Module:
    """A linear layer whose weight is stored transposed: (4, 6) with strides (1, 4)."""
    module = nn.Linear(6, 4)
    module.weight = nn.Parameter(torch.randn(6, 4).t())
    return module


def _largest_dim(param: nn.Parameter) -> Shard:
    """Shards each parameter on its largest dim."""
    return Shard(max(range(param.ndim), key=param.size))


def _left_on_meta(mesh: DeviceMesh, shard: FullyShard) -> None:
    """Sharded on meta and never materialized (no to_empty / reset_parameters), then run."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    shard(model[0], mesh=mesh)
    shard(model, mesh=mesh)
    model(torch.randn(2, 4))


def _copy_of_a_block_sharded_model(mesh: DeviceMesh, shard: FullyShard) -> None:
    """The root is not sharded, one of its blocks is."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    shard(model[0], mesh=mesh)
    copy.deepcopy(model)


NEW_BAD_CALLS: dict[str, BadCall] = {
    "mesh_not_a_device_mesh": (
        ArgumentTypeError, "mesh must be a DeviceMesh, got str",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh="cpu")),
    "two_d_mesh_without_dim_names": (
        AssertionError, r"mesh_dim_names.*2-D \(1, 2\).*mesh_dim_names=\('replicate', 'shard'\)",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2)))),
    "module_list_container": (
        ValueError, "containers that do not implement forward: module is an nn.ModuleList",
        lambda mesh, shard: shard(nn.ModuleList([nn.Linear(4, 4)]), mesh=mesh)),
    "module_dict_container": (
        ValueError, "containers that do not implement forward: module is an nn.ModuleDict",
        lambda mesh, shard: shard(nn.ModuleDict({"proj": nn.Linear(4, 4)}), mesh=mesh)),
    "mixed_devices_cpu_and_meta": (
        ValueError, r"several device types \('lin.bias' on cpu, 'extra' on meta\)",
        lambda mesh, shard: shard(_WithParam(_meta(4)), mesh=mesh)),
    "zero_dim_parameter": (
        ValueError, r"scalar parameters: 'extra' is 0-dim. Change extra to a 1D tensor",
        lambda mesh, shard: shard(_WithParam(torch.tensor(2.0)), mesh=mesh)),
    "non_contiguous_parameter": (
        NotImplementedError, r"non-contiguous parameters: parameter 'weight' .* \(1, 4\)",
        lambda mesh, shard: shard(_column_major_weight(), mesh=mesh)),
    "mixed_trainable_dtypes": (
        ValueError, r"'0.bias' is torch.float32, '1.bias' is torch.bfloat16",
        lambda mesh, shard: shard(_mixed_dtypes(), mesh=mesh)),
    "shard_dim_out_of_range": (AssertionError, r"Shard\(2\) for parameter 'weight'", _placement(2)),
    "shard_dim_out_of_range_1d": (
        AssertionError, r"Shard\(1\) for parameter 'bias'", _placement(1)),
    "shard_dim_negative_out_of_range": (
        AssertionError, r"Shard\(-3\) for parameter 'weight'", _placement(-3)),
    "uneven_shard_on_largest_dim": (
        NotImplementedError, r"uneven sharding on dim 1: parameter 'weight'.*size\(1\)=5",
        lambda mesh, shard: shard(nn.Linear(5, 2), mesh=mesh, shard_placement_fn=_largest_dim)),
    "root_before_child": (
        ShardingOrderError, "'weight' was already sharded.*bottom-up", _root_then_child),
    "already_sharded_by_torch_fsdp2": (
        AssertionError, r"once, and this FSDPLinear already has torch's fully_shard \(FSDP2\)",
        lambda mesh, shard: shard(fsdp2_fully_shard(nn.Linear(4, 4), mesh=mesh), mesh=mesh)),
    "weight_tied_across_groups": (
        ValueError, r"'0.weight' is shared with a parameter already managed.*fully_shard\(\[",
        _tied_across_groups),
    "parameters_left_on_meta": (
        RuntimeError, r"(?s)materialized from meta device.*\['2.weight', '2.bias'\].*to_empty",
        _left_on_meta),
    "deepcopy_of_sharded_model": (
        AssertionError, "does not support deepcopy: FSDPLinear is sharded",
        lambda mesh, shard: copy.deepcopy(_sharded_linear(mesh, shard))),
    "deepcopy_of_model_with_a_sharded_block": (
        AssertionError, "does not support deepcopy.*state dict", _copy_of_a_block_sharded_model),
    "mp_param_dtype_int8": (
        TypeError, r"mp_policy.param_dtype=torch.int8", _policy(param_dtype=torch.int8)),
    "mp_reduce_dtype_int32": (
        TypeError, r"mp_policy.reduce_dtype=torch.int32", _policy(reduce_dtype=torch.int32)),
    "mp_output_dtype_int64": (
        TypeError, r"mp_policy.output_dtype=torch.int64", _policy(output_dtype=torch.int64)),
    "reshard_after_forward_str": (
        ValueError, "reshard_after_forward must be None, a bool or an int, got str",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward="yes")),
    "reshard_after_forward_int_not_a_factor": (
        ValueError, "reshard_after_forward=3 must be a factor of the shard mesh size 2",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)),
    "module_list_empty": (
        EmptyModuleListError, "module is an empty list", lambda mesh, shard: shard([], mesh=mesh)),
    "module_list_with_a_tensor": (
        ArgumentTypeError, r"module\[1\] must be an nn.Module, got Tensor",
        lambda mesh, shard: shard([nn.Linear(4, 4), torch.ones(4)], mesh=mesh)),
    "offload_policy_not_a_policy": (
        TypeError, "offload_policy must be a torch.distributed.fsdp.OffloadPolicy",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh, offload_policy="cpu")),
    "ignored_params_single_parameter": (
        TypeError, r"ignored_params must be a set of nn.Parameters, got Parameter",
        _ignore_one_parameter),
    "unshard_async_op_not_bool": (
        TypeError, "async_op must be a bool, got str",
        lambda mesh, shard: _sharded_linear(mesh, shard).unshard("yes")),
    "bucket_over_max_bucket_bytes": (
        ValueError, r"'weight' \(16, 16\).*1088 bytes.*split the module", _bucket_over_limit),
    "forward_input_on_meta": (
        RuntimeError, "FSDPLinear.forward got argument 0 on meta.*sharded on cpu",
        lambda mesh, shard: _sharded_linear(mesh, shard)(_meta(2, 4))),
    "forward_keyword_input_on_meta": (
        RuntimeError, "got argument 'input' on meta",
        lambda mesh, shard: _sharded_linear(mesh, shard)(input=_meta(2, 4))),
    "set_requires_gradient_sync_not_bool": (
        TypeError, "requires_gradient_sync must be a bool, got str",
        lambda mesh, shard: _sharded_linear(mesh, shard).set_requires_gradient_sync("no")),
    "set_reshard_after_backward_not_bool": (
        TypeError, "reshard_after_backward must be a bool, got NoneType",
        lambda mesh, shard: _sharded_linear(mesh, shard).set_reshard_after_backward(None)),
}


def fully_shard_bad_calls() -> dict[str, BadCall]:
    """Every ``fully_shard``-level bad call: ``test_fully_shard_features``' and the new ones."""
    from tests.fsdp.test_fully_shard_features import BAD_CALLS

    overlap = set(BAD_CALLS) & set(NEW_BAD_CALLS)
    assert not overlap, f"cases defined twice: {overlap}"
    return {**BAD_CALLS, **NEW_BAD_CALLS}


# The module-level default-mesh case cannot run inside an initialized world.
NO_PROCESS_GROUP: BadCall = (
    ValueError, "needs an initialized process group when mesh is None",
    lambda mesh, shard: shard(nn.Linear(4, 4)))


def collective_bad_calls(group: dist.ProcessGroup, rank: int) -> dict[str, tuple]:
    """Foreach-collective bad calls beyond ``test_validation``'s, in its format
    ``name -> (call, exception type, regex)``: buckets over ``config.max_bucket_bytes``.

    The bucket is 4 GiB across the ranks; its tensors are on the meta device, so a
    missing check would reach the (failing or mismatched) collective, not allocate.
    """
    infos = [make_shard_info((2**15 + 1, 2**15), group.size(), rank)]
    shards = [torch.empty(infos[0].sharded_size, device="meta")]
    grads = [torch.empty(infos[0].global_size, device="meta")]
    over = r"needs \d+ bytes per collective .*config\.max_bucket_bytes.*split the module"
    return {
        "gather_bucket_over_max_bucket_bytes": (
            lambda: foreach_all_gather(shards, infos, group), ValueError, over),
        "reduce_bucket_over_max_bucket_bytes": (
            lambda: foreach_reduce(grads, infos, group), ValueError, over),
    }


# -- on real ranks ----------------------------------------------------------------

_COLLECTIVES = (
    "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather", "barrier",
    "all_to_all_single", "reduce_scatter", "reduce", "gather", "scatter", "send", "recv",
    "isend", "irecv", "all_gather_object", "broadcast_object_list",
)


@contextlib.contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Records every c10d collective called (through ``torch.distributed`` or
    ``distributed_c10d``) while open; the list holds their names."""
    from torch.distributed import distributed_c10d

    calls: list[str] = []
    originals = [(module, name, getattr(module, name))
                 for module in (dist, distributed_c10d) for name in _COLLECTIVES
                 if hasattr(module, name)]  # torch 2.11 has no *_single names

    def counted(name: str, original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(*args, **kwargs)
        return call

    for module, name, original in originals:
        setattr(module, name, counted(name, original))
    try:
        yield calls
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def every_bad_call(mesh: DeviceMesh, rank: int) -> dict[str, tuple[type[Exception], str, Callable]]:
    """Every case, ``fully_shard``-level and collective-level, as ``(error, regex, call())``."""
    from tests.collectives import test_validation

    group = mesh.get_group()
    cases = {name: (error, match, lambda call=call: call(mesh, fully_shard))
             for name, (error, match, call) in fully_shard_bad_calls().items()}
    for source in (test_validation.bad_calls(group, rank), collective_bad_calls(group, rank)):
        cases.update({name: (error, match, call) for name, (call, error, match) in source.items()})
    return cases


def both_ranks_make_bad_calls(rank: int, world_size: int) -> dict[str, Any]:
    """Rank body: every rank makes every bad call, then all ranks all-reduce a probe.

    Returns:
        ``cases``: ``name -> (exception type, message, collectives started during the
        call, probe all-reduce result)``; ``grads``: the full gradients of a valid
        fully_shard step afterwards, ``expected_grads`` the unsharded ones, and
        ``valid_step_collectives`` the collectives that step started.
    """
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name, (_, _, call) in every_bad_call(mesh, rank).items():
        kind, message = "none", ""
        with count_collectives() as started:
            try:
                call()
            except Exception as exc:  # noqa: BLE001  (the parent test checks the type)
                kind, message = type(exc).__name__, str(exc)
        probe = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
        dist.all_reduce(probe)
        results[name] = (kind, message, list(started), probe.tolist())
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 3), mesh=mesh)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    with count_collectives() as valid_started:
        model(x).square().sum().backward()
    all_x = torch.cat([torch.randn(2, 4, generator=torch.Generator().manual_seed(r))
                       for r in range(world_size)])
    (reference(all_x).square().sum() / world_size).backward()
    return {"cases": results, "valid_step_collectives": list(valid_started),
            "grads": [p.grad.full_tensor() for p in model.parameters()],
            "expected_grads": [p.grad for p in reference.parameters()]}


# -- the docs/errors.md tables ----------------------------------------------------


def raised(call: Callable[[], object]) -> tuple[type[Exception], str]:
    """``(exception type, message)`` of ``call()``, which must raise."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001  (every case raises by construction)
        return type(exc), str(exc)
    raise AssertionError("the call did not raise")


def fsdp2_raises(name: str, mesh: DeviceMesh | None) -> type[Exception] | None:
    """What FSDP2 (torch's ``fully_shard``) raises for the ``fully_shard``-level case
    ``name`` (``None``: it accepts the call), on a fake world's ``mesh`` (``None``: the
    default-mesh case, run outside any world and without torchrun's variables, from
    which FSDP2 would initialize a process group itself)."""
    if mesh is None:
        call = NO_PROCESS_GROUP[2]
        rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in rendezvous}
        context: contextlib.AbstractContextManager = mock.patch.dict(os.environ, env, clear=True)
    else:
        call = fully_shard_bad_calls()[name][2]
        context = contextlib.nullcontext()
    with context:
        try:
            call(mesh, fsdp2_fully_shard)
        except Exception as exc:  # noqa: BLE001  (any exception is FSDP2's answer)
            return type(exc)
        finally:
            if mesh is None and dist.is_initialized():  # never expected: no rendezvous
                dist.destroy_process_group()
    return None


def type_cell(kind: type[Exception] | None) -> str:
    """A markdown cell naming ``kind``, with its built-in bases for our own types."""
    if kind is None:
        return "accepts"
    if kind.__module__ == "builtins":
        return f"`{kind.__name__}`"
    bases = ", ".join(f"`{base.__name__}`" for base in kind.__bases__)
    return f"`{kind.__name__}` ({bases})"


def message_start(message: str, length: int = 120) -> str:
    """The first ``length`` characters of ``message``, for a markdown table cell."""
    message = re.sub(r"0x[0-9a-f]+", "0x...", message)
    cut = message if len(message) <= length else message[:length].rstrip() + " ..."
    return cut.replace("|", "\\|").replace("\n", " ")


def fsdp2_and_ours() -> list[tuple[str, type[Exception] | None, type[Exception], str]]:
    """Every ``fully_shard``-level case (the default-mesh one first) on a fake two-rank
    world: ``(name, FSDP2's exception or None, ours, our message)``."""
    assert not dist.is_initialized(), "fsdp2_and_ours() sets up its own fake world"
    rows = [("no_process_group", fsdp2_raises("no_process_group", None),
             *raised(lambda: NO_PROCESS_GROUP[2](None, fully_shard)))]
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        for name, (_, _, call) in fully_shard_bad_calls().items():
            rows.append((name, fsdp2_raises(name, mesh),
                         *raised(lambda call=call: call(mesh, fully_shard))))
    return rows


def errors_table() -> str:
    """The ``docs/errors.md`` tables, from running every case on a fake two-rank world,
    the ``fully_shard``-level ones on FSDP2 too."""
    from tests.collectives import test_validation

    fake_group = test_validation.FAKE_GROUP
    collective_cases = {**test_validation.CASES, **collective_bad_calls(fake_group, 0)}
    collective_rows = [(name, *raised(call)) for name, (call, _, _) in collective_cases.items()]
    fully_shard_table = (
        "| case | FSDP2 raises | ours raises | our message starts |\n|---|---|---|---|\n"
        + "".join(f"| `{name}` | {type_cell(theirs)} | {type_cell(ours)} | "
                  f"{message_start(text)} |\n" for name, theirs, ours, text in fsdp2_and_ours())
    )
    collective_table = (
        "| case | exception | message starts |\n|---|---|---|\n"
        + "".join(f"| `{name}` | {type_cell(kind)} | {message_start(text)} |\n"
                  for name, kind, text in collective_rows)
    )
    return (
        "`fully_shard` and a sharded model (FSDP2: torch's `fully_shard` given the same "
        "call):\n\n" + fully_shard_table
        + "\nThe foreach collectives (`foreach_all_gather`, `foreach_reduce`; FSDP2 has no "
        "counterpart):\n\n" + collective_table
    )


if __name__ == "__main__":
    print(errors_table())
