"""Bad inputs to the foreach collectives raise a clear error before any collective.

Single process: every bad call runs against a fake two-rank process group with the
communication functions replaced by ones that fail the test, so an error raised
after a collective started is caught. On real gloo ranks: rank 0 makes each bad call
alone and both ranks then all-reduce; had rank 0 entered a collective, that
all-reduce would pair with it and come out wrong or time out.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup

import fsdp_traceable
from fsdp_traceable import foreach_all_gather, foreach_reduce, make_shard_info
from fsdp_traceable.testing.local_ranks import run_on_local_ranks

BF16, FP32 = torch.bfloat16, torch.float32
# name -> (call, exception type, regex the message must match: it names the culprit)
BadCall = tuple[Callable[[], object], type[Exception], str]


def bad_calls(group: dist.ProcessGroup, rank: int) -> dict[str, BadCall]:
    """Every bad call, for ``rank`` of a two-rank ``group``."""
    infos = [make_shard_info((4, 3), 2, rank), make_shard_info((5,), 2, rank)]
    shards = [torch.zeros(2, 3), torch.zeros(3 if rank == 0 else 2)]
    grads = [torch.zeros(4, 3), torch.zeros(5)]
    meta_shards = [shards[0], shards[1].to("meta")]
    infos_world4 = [make_shard_info(i.global_size, 4, rank) for i in infos]
    infos_other_rank = [make_shard_info(i.global_size, 2, 1 - rank) for i in infos]
    mixed_reduce = [infos[0], make_shard_info((5,), 2, rank, reduce_dtype=BF16)]
    shards_world4 = [torch.zeros(i.sharded_size) for i in infos_world4]
    mixed_orig = [infos[0], make_shard_info((5,), 2, rank, orig_dtype=BF16, param_dtype=FP32)]

    def gather(tensors: object, infos_: object = infos) -> Callable[[], object]:
        return lambda: foreach_all_gather(tensors, infos_, group)

    def reduce(grads_: object = grads, infos_: object = infos, **kw: object):
        return lambda: foreach_reduce(grads_, infos_, group, **kw)

    def with_path(path: str) -> Callable[[], object]:
        def call() -> object:
            with fsdp_traceable.config.patch(collectives_path=path):
                return foreach_all_gather(shards, infos, group)
        return call

    return {
        "gather_not_a_list": (gather(shards[0]), TypeError, "sharded_tensors must be a list"),
        "gather_infos_not_shard_info": (gather(shards, ["x", "y"]), TypeError,
                                        "infos must be a list of ShardInfo"),
        "gather_empty": (gather([], []), ValueError, "sharded_tensors is empty"),
        "gather_length_mismatch": (gather(shards[:1]), ValueError,
                                   "sharded_tensors has 1 tensors but infos has 2"),
        "gather_wrong_size": (gather([torch.zeros(4, 3), shards[1]]), ValueError,
                              r"sharded_tensors\[0\] has size \(4, 3\).*sharded size \(2, 3\)"),
        "gather_int_dtype": (gather([shards[0].long(), shards[1]]), TypeError,
                             r"sharded_tensors\[0\] has dtype torch.int64"),
        "gather_mixed_devices": (gather(meta_shards), ValueError,
                                 r"sharded_tensors are on several devices \['cpu', 'meta'\]"),
        "gather_infos_for_world_4": (gather(shards_world4, infos_world4), ValueError,
                                     "infos were built for world_size=4"),
        "gather_infos_for_other_rank": (gather(shards[:1], infos_other_rank[:1]), ValueError,
                                        f"infos were built for world_size=2, rank={1 - rank}"),
        "gather_infos_mix_world_sizes": (gather([shards[0], shards_world4[1]],
                                                [infos[0], infos_world4[1]]),
                                         ValueError, "infos mix world sizes"),
        "gather_unknown_path": (with_path("fast"), ValueError, "collectives_path='fast'"),
        "reduce_empty": (reduce([], []), ValueError, "unsharded_grads is empty"),
        "reduce_length_mismatch": (reduce(grads, infos[:1]), ValueError,
                                   "unsharded_grads has 2 tensors but infos has 1"),
        "reduce_sharded_size_given": (reduce(shards), ValueError,
                                      r"unsharded_grads\[0\] has size \(2, 3\).*unsharded"),
        "reduce_int_dtype": (reduce([grads[0], grads[1].int()]), TypeError,
                             r"unsharded_grads\[1\] has dtype torch.int32"),
        "reduce_mixed_devices": (reduce([grads[0], grads[1].to("meta")]), ValueError,
                                 "unsharded_grads are on several devices"),
        "reduce_mixed_grad_dtypes": (reduce([grads[0], grads[1].to(BF16)]), ValueError,
                                     "unsharded_grads dtype must be uniform"),
        "reduce_mixed_reduce_dtypes": (reduce(infos_=mixed_reduce), ValueError,
                                       "reduce_dtype must be uniform"),
        "reduce_mixed_orig_dtypes": (reduce(infos_=mixed_orig), ValueError,
                                     "orig_dtype must be uniform"),
        "reduce_infos_for_world_4": (reduce(infos_=infos_world4), ValueError,
                                     "infos were built for world_size=4"),
        "reduce_op_max_enum": (reduce(reduce_op=dist.ReduceOp.MAX), ValueError,
                               "reduce_op=.*MAX.* is not supported"),
        "reduce_op_premul_sum_enum": (reduce(reduce_op=dist.ReduceOp.PREMUL_SUM), ValueError,
                                      "reduce_op=.*PREMUL_SUM.* is not supported"),
        "reduce_op_premul_sum_factor": (reduce(reduce_op=dist._make_nccl_premul_sum(0.5)),
                                        ValueError, "reduce_op=.* is not supported"),
        "reduce_op_max_string": (reduce(reduce_op="max"), ValueError,
                                 "reduce_op='max' is not supported"),
        "reduce_accumulate_into_length": (
            reduce(accumulate_into=[torch.nn.Parameter(torch.zeros(2, 3))]), ValueError,
            "accumulate_into has 1 parameters for 2 gradients"),
        "reduce_zero_divide_factor": (reduce(gradient_divide_factor=0.0), ValueError,
                                      "gradient_divide_factor must be a positive number"),
        "reduce_accumulate_into_not_tensor": (
            reduce(accumulate_into=["w", "b"]), TypeError,
            r"accumulate_into\[0\] must be a tensor"),
        "reduce_accumulate_into_wrong_shape": (
            reduce(accumulate_into=[torch.zeros(4, 3), torch.zeros(5)]), ValueError,
            r"accumulate_into\[0\] has local size \(4, 3\)"),
        "reduce_accumulate_into_wrong_dtype": (
            reduce(accumulate_into=[torch.zeros(2, 3, dtype=BF16), torch.zeros(shards[1].shape)]),
            ValueError, r"accumulate_into\[0\] has local size .* torch.bfloat16"),
        "reduce_partial_output_wrong_size": (
            reduce(partial_reduce_output=torch.zeros(3), all_reduce_grads=False,
                   all_reduce_group=group),
            ValueError, r"partial_reduce_output must be a flat \(9,\) torch.float32 tensor"),
        "reduce_skip_all_reduce_without_group": (
            reduce(all_reduce_grads=False), ValueError,
            "all_reduce_grads=False skips the HSDP all-reduce, but no all_reduce_group"),
    }


FAKE_GROUP = FakeProcessGroup._create_internal(0, 2)
CASES = bad_calls(FAKE_GROUP, 0)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("path", ["eager", "traced"])
def test_bad_input_raises_before_collective(no_collectives: None, name: str, path: str) -> None:
    call, error, match = CASES[name]
    with fsdp_traceable.config.patch(collectives_path=path):
        with pytest.raises(error, match=match):
            call()


def test_good_input_reaches_collective(no_collectives: None) -> None:
    """The guard above is live: valid input does reach the (failing) collective."""
    infos = [make_shard_info((4, 3), 2, 0)]
    with pytest.raises(AssertionError, match="a collective started"):
        foreach_all_gather([torch.zeros(2, 3)], infos, FAKE_GROUP)
    with pytest.raises(AssertionError, match="a collective started"):
        foreach_reduce([torch.zeros(4, 3)], infos, FAKE_GROUP)


def bad_calls_on_rank0(rank: int, world_size: int) -> list[tuple[str, str, list[float]]]:
    """Rank body: rank 0 makes each bad call alone, then both ranks all-reduce.

    Returns:
        ``(case, exception type name, all-reduce result)`` per case, then a valid
        ``foreach_reduce`` of ones as the last entry.
    """
    group = dist.group.WORLD
    out = []
    for name, (call, error, match) in bad_calls(group, rank).items():
        raised = "none"
        if rank == 0:
            try:
                call()
            except (TypeError, ValueError) as exc:
                raised = type(exc).__name__
        probe = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
        dist.all_reduce(probe)
        out.append((name, raised, probe.tolist()))
    info = make_shard_info((4, 3), world_size, rank)
    grads = foreach_reduce([torch.full((4, 3), float(rank + 1))], [info], group).sharded_grads
    out.append(("valid_reduce", "none", grads[0].flatten().tolist()))
    return out


@pytest.mark.gloo
def test_group_usable_after_bad_input_on_gloo() -> None:
    per_rank = run_on_local_ranks(bad_calls_on_rank0, 2, timeout_s=30)
    names = list(CASES) + ["valid_reduce"]
    assert [n for n, _, _ in per_rank[0]] == names
    for rank, results in enumerate(per_rank):
        for name, raised, values in results[:-1]:
            expected = CASES[name][1].__name__ if rank == 0 else "none"
            assert raised == expected, f"rank {rank} {name}"
            assert values == [3.0, 30.0], f"rank {rank} {name}: all-reduce gave {values}"
        assert results[-1][2] == [1.5] * 6, f"rank {rank}: valid reduce after the errors"
