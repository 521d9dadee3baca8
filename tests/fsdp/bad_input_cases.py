"""Bad calls to ``fully_shard`` and to a sharded model, and the tables of ``docs/errors.md``.

Each case is ``name -> (exception type, regex the message must match, call(mesh))``,
the format of ``BAD_CALLS`` in ``test_fully_shard_features`` (whose cases are reused,
not repeated, here). ``python -m tests.fsdp.bad_input_cases`` prints the ``docs/errors.md`` tables of
every case, these and the foreach collectives' cases of ``test_validation``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

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
from fsdp_traceable.testing.fake_world import fake_process_group

BadCall = tuple[type[Exception], str, Callable[[DeviceMesh], object]]


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


def _root_then_child(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, mesh=mesh)
    fully_shard(model[0], mesh=mesh)


def _tied_across_groups(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)


def _sharded_linear(mesh: DeviceMesh) -> nn.Module:
    return fully_shard(nn.Linear(4, 4), mesh=mesh)


def _ignore_one_parameter(mesh: DeviceMesh) -> None:
    module = nn.Linear(4, 4)
    fully_shard(module, mesh=mesh, ignored_params=module.weight)


def _meta(*size: int) -> torch.Tensor:
    return torch.zeros(*size, device="meta")


def _policy(**kwargs: object) -> Callable[[DeviceMesh], object]:
    return lambda mesh: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                    mp_policy=MixedPrecisionPolicy(**kwargs))


def _placement(dim: int) -> Callable[[DeviceMesh], object]:
    return lambda mesh: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                    shard_placement_fn=lambda p: Shard(dim))


def _bucket_over_limit(mesh: DeviceMesh) -> None:
    with fsdp_traceable.config.patch(max_bucket_bytes=1000):  # Linear(16, 16) is 1088 bytes
        fully_shard(nn.Linear(16, 16), mesh=mesh)


NEW_BAD_CALLS: dict[str, BadCall] = {
    "mesh_not_a_device_mesh": (
        ValueError, "mesh must be a 1-D DeviceMesh",
        lambda mesh: fully_shard(nn.Linear(4, 4), mesh="cpu")),
    "mixed_devices_cpu_and_meta": (
        ValueError, r"several device types \('lin.bias' on cpu, 'extra' on meta\)",
        lambda mesh: fully_shard(_WithParam(_meta(4)), mesh=mesh)),
    "zero_dim_parameter": (
        ValueError, r"parameter 'extra': .*0-dim parameter",
        lambda mesh: fully_shard(_WithParam(torch.tensor(2.0)), mesh=mesh)),
    "mixed_trainable_dtypes": (
        ValueError, r"'0.bias' is torch.float32, '1.bias' is torch.bfloat16",
        lambda mesh: fully_shard(_mixed_dtypes(), mesh=mesh)),
    "shard_dim_out_of_range": (ValueError, r"Shard\(2\) for parameter 'weight'", _placement(2)),
    "shard_dim_out_of_range_1d": (ValueError, r"Shard\(1\) for parameter 'bias'", _placement(1)),
    "shard_dim_negative_out_of_range": (
        ValueError, r"Shard\(-3\) for parameter 'weight'", _placement(-3)),
    "root_before_child": (ValueError, "'weight' was already sharded.*bottom-up", _root_then_child),
    "already_sharded_by_torch_fsdp2": (
        ValueError, "'weight' is already a DTensor",
        lambda mesh: fully_shard(fsdp2_fully_shard(nn.Linear(4, 4), mesh=mesh), mesh=mesh)),
    "weight_tied_across_groups": (
        ValueError, "'0.weight' is shared.*common ancestor", _tied_across_groups),
    "mp_param_dtype_int8": (
        TypeError, r"mp_policy.param_dtype=torch.int8", _policy(param_dtype=torch.int8)),
    "mp_reduce_dtype_int32": (
        TypeError, r"mp_policy.reduce_dtype=torch.int32", _policy(reduce_dtype=torch.int32)),
    "mp_output_dtype_int64": (
        TypeError, r"mp_policy.output_dtype=torch.int64", _policy(output_dtype=torch.int64)),
    "reshard_after_forward_str": (
        TypeError, "reshard_after_forward must be None, a bool or an int, got str",
        lambda mesh: fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward="yes")),
    "reshard_after_forward_int_not_a_factor": (
        ValueError, "reshard_after_forward=3 must be a factor of the shard mesh size 2",
        lambda mesh: fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)),
    "module_list_empty": (
        ValueError, "module is an empty list", lambda mesh: fully_shard([], mesh=mesh)),
    "module_list_with_a_tensor": (
        TypeError, r"module\[1\] must be an nn.Module, got Tensor",
        lambda mesh: fully_shard([nn.Linear(4, 4), torch.ones(4)], mesh=mesh)),
    "offload_policy_not_a_policy": (
        TypeError, "offload_policy must be a torch.distributed.fsdp.OffloadPolicy",
        lambda mesh: fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy="cpu")),
    "ignored_params_single_parameter": (
        TypeError, r"ignored_params must be a set of nn.Parameters, got Parameter",
        lambda mesh: _ignore_one_parameter(mesh)),
    "unshard_async_op_not_bool": (
        TypeError, "async_op must be a bool, got str",
        lambda mesh: _sharded_linear(mesh).unshard("yes")),
    "bucket_over_max_bucket_bytes": (
        ValueError, r"'weight' \(16, 16\).*1088 bytes.*split the module", _bucket_over_limit),
    "forward_input_on_meta": (
        ValueError, "FSDPLinear.forward got argument 0 on meta.*sharded on cpu",
        lambda mesh: _sharded_linear(mesh)(_meta(2, 4))),
    "forward_keyword_input_on_meta": (
        ValueError, "got argument 'input' on meta",
        lambda mesh: _sharded_linear(mesh)(input=_meta(2, 4))),
    "set_requires_gradient_sync_not_bool": (
        TypeError, "requires_gradient_sync must be a bool, got str",
        lambda mesh: _sharded_linear(mesh).set_requires_gradient_sync("no")),
    "set_reshard_after_backward_not_bool": (
        TypeError, "reshard_after_backward must be a bool, got NoneType",
        lambda mesh: _sharded_linear(mesh).set_reshard_after_backward(None)),
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
    lambda mesh: fully_shard(nn.Linear(4, 4)))


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
    cases = {name: (error, match, lambda call=call: call(mesh))
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


def raised(call: Callable[[], object]) -> tuple[str, str]:
    """``(exception type name, message)`` of ``call()``, which must raise."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001  (every case raises by construction)
        return type(exc).__name__, str(exc)
    raise AssertionError("the call did not raise")


def message_start(message: str, length: int = 120) -> str:
    """The first ``length`` characters of ``message``, for a markdown table cell."""
    message = re.sub(r"0x[0-9a-f]+", "0x...", message)
    cut = message if len(message) <= length else message[:length].rstrip() + " ..."
    return cut.replace("|", "\\|")


def errors_table() -> str:
    """The ``docs/errors.md`` tables, from running every case on a fake two-rank world."""
    from tests.collectives import test_validation

    assert not dist.is_initialized(), "errors_table() sets up its own fake world"
    rows = [("no_process_group", *raised(lambda: NO_PROCESS_GROUP[2](None)))]
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        rows += [(name, *raised(lambda: call(mesh)))
                 for name, (_, _, call) in fully_shard_bad_calls().items()]
    fake_group = test_validation.FAKE_GROUP
    collective_cases = {**test_validation.CASES, **collective_bad_calls(fake_group, 0)}
    collective_rows = [(name, *raised(call)) for name, (call, _, _) in collective_cases.items()]
    header = "| case | exception | message starts |\n|---|---|---|\n"

    def table(entries: list[tuple[str, str, str]]) -> str:
        return header + "".join(f"| `{name}` | `{kind}` | {message_start(text)} |\n"
                                for name, kind, text in entries)

    return (
        "`fully_shard` and a sharded model:\n\n" + table(rows)
        + "\nThe foreach collectives (`foreach_all_gather`, `foreach_reduce`):\n\n"
        + table(collective_rows)
    )


if __name__ == "__main__":
    print(errors_table())
