"""Bad input to ``fully_shard`` and to a sharded model fails loudly, early and everywhere.

Every case (here, in ``test_fully_shard_features.BAD_CALLS`` and in
``test_validation``) must raise an exception that names the culprit, before any
collective starts; where torch's FSDP2 raises for the same ``fully_shard``-level call,
ours is an instance of FSDP2's exception type (FSDP2 is called here, so this cannot
drift). Single process: the new cases run on a fake two-rank
world with the library's communication functions replaced by ones that fail the test.
On two real gloo ranks: both ranks make every bad call with every c10d collective
counted, both raise the same error, and an all-reduce right after each call (and a
valid training step at the end) still gives the right numbers, under a 20 s
collective timeout so a rank stuck in a collective fails the test instead of hanging.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed.device_mesh import DeviceMesh

import fsdp_traceable
from fsdp_traceable.collectives import comm
from fsdp_traceable.collectives.shard_info import make_shard_info
from fsdp_traceable.collectives.validation import bucket_bytes, check_bucket_bytes
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.collectives.test_validation import FAKE_GROUP
from tests.fsdp.bad_input_cases import (
    NEW_BAD_CALLS,
    NO_PROCESS_GROUP,
    both_ranks_make_bad_calls,
    collective_bad_calls,
    errors_table,
    every_bad_call,
    fsdp2_and_ours,
)
from tests.fsdp.test_fully_shard_features import BAD_CALLS

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
ERRORS_DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@pytest.mark.parametrize("name", list(NEW_BAD_CALLS))
def test_bad_fully_shard_call_raises_before_any_collective(
    no_collectives, fake_mesh, name
):
    error, match, call = NEW_BAD_CALLS[name]
    with pytest.raises(error, match=match):
        call(fake_mesh, fsdp_traceable.fully_shard)


@pytest.mark.parametrize("name", list(collective_bad_calls(FAKE_GROUP, 0)))
@pytest.mark.parametrize("path", ["eager", "traced"])
def test_oversized_bucket_rejected_before_collective(no_collectives, name, path):
    call, error, match = collective_bad_calls(FAKE_GROUP, 0)[name]
    with fsdp_traceable.config.patch(collectives_path=path):
        with pytest.raises(error, match=match):
            call()


def test_default_mesh_without_process_group_raises() -> None:
    assert not dist.is_initialized()
    error, match, call = NO_PROCESS_GROUP
    with pytest.raises(error, match=match):
        call(None, fsdp_traceable.fully_shard)


def test_ours_raises_wherever_fsdp2_raises_and_an_exception_of_its_type() -> None:
    """Every ``fully_shard``-level case, run on torch's ``fully_shard`` and on ours: where
    FSDP2 raises, ours raises an instance of FSDP2's exception type (ours may be a
    subclass that is also the conventional type; see ``fsdp.arguments``)."""
    rows = fsdp2_and_ours()
    assert len(rows) == len(NEW_BAD_CALLS) + len(BAD_CALLS) + 1
    mismatched = {name: (theirs.__name__, ours.__name__) for name, theirs, ours, _ in rows
                  if theirs is not None and not issubclass(ours, theirs)}
    assert not mismatched, f"(FSDP2's type, ours) differ: {mismatched}"
    # The cases the suite is about: FSDP2 rejects each of them.
    rejected_by_fsdp2 = {name for name, theirs, _, _ in rows if theirs is not None}
    assert {"applied_twice", "three_d_mesh", "two_d_mesh_without_dim_names",
            "module_list_container", "module_dict_container", "zero_dim_parameter",
            "non_contiguous_parameter", "shard_dim_out_of_range", "uneven_shard_1",
            "uneven_shard_on_largest_dim", "weight_tied_across_groups",
            "parameters_left_on_meta", "deepcopy_of_sharded_model"} <= rejected_by_fsdp2


def test_valid_forward_reaches_the_collective(no_collectives, fake_mesh):
    """The guard is live: a correct input does reach the (failing) all-gather."""
    model = fsdp_traceable.fully_shard(torch.nn.Linear(4, 4), mesh=fake_mesh)
    with pytest.raises(AssertionError, match="a collective started"):
        model(torch.randn(2, 4))


# -- the bucket size limit, from ShardInfos only ------------------------------------


def _expected_bytes(infos) -> int:
    """Independent arithmetic: every rank's padded shard, in the bigger of the two dtypes."""
    per_rank = max(
        sum(i.padded_sharded_numel * torch.empty((), dtype=i.param_dtype).element_size()
            for i in infos),
        sum(i.padded_sharded_numel * torch.empty((), dtype=i.reduce_dtype).element_size()
            for i in infos),
    )
    return per_rank * infos[0].world_size


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_bucket_bytes_counts_padded_shards_in_both_dtypes(world_size: int) -> None:
    buckets = [
        [make_shard_info((7, 5), world_size, 0)],  # uneven dim 0: padded rows count
        [make_shard_info((7, 5), world_size, world_size - 1, param_dtype=BF16),
         make_shard_info((3,), world_size, world_size - 1, param_dtype=BF16)],
        [make_shard_info((9, 2), world_size, 0, param_dtype=BF16, reduce_dtype=FP32)],
        [make_shard_info((9, 2), world_size, 0, orig_dtype=FP16),  # mixed: uint8 bytes add
         make_shard_info((4, 4), world_size, 0)],
        [make_shard_info((0, 4), world_size, 0)],
    ]
    for infos in buckets:
        assert bucket_bytes(infos) == _expected_bytes(infos)
    padded_rows = -(-7 // world_size)
    assert bucket_bytes(buckets[0]) == padded_rows * 5 * 4 * world_size


def test_bucket_at_the_int32_limit_passes_one_byte_more_fails() -> None:
    assert fsdp_traceable.config.max_bucket_bytes == 2**31 - 1
    check_bucket_bytes([make_shard_info((2**30 - 1,), 1, 0, orig_dtype=FP16)])  # 2**31 - 2
    with pytest.raises(ValueError, match=r"'infos\[0\]' \(1073741824,\)\) needs 2147483648 bytes"):
        check_bucket_bytes([make_shard_info((2**30,), 1, 0, orig_dtype=FP16)])
    # 8 ranks of 2**28 fp32 elements each (8 GiB) plus a (4,) bias padded to 1 element
    # per rank; the largest parameters are named first.
    huge = make_shard_info((2**31, 1), 8, 3)
    named = r"'layers.0.w' \(2147483648, 1\), 'bias' \(4,\)\) needs 8589934624 bytes"
    with pytest.raises(ValueError, match=named):
        check_bucket_bytes([make_shard_info((4,), 8, 3), huge], ["bias", "layers.0.w"])
    with fsdp_traceable.config.patch(max_bucket_bytes=2**34):
        check_bucket_bytes([huge])


# -- on two real gloo ranks --------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    return run_on_local_ranks(both_ranks_make_bad_calls, 2, timeout_s=20)


def _local_cases(rank: int = 0) -> dict:
    """Every case's expected ``(error, regex)`` for ``rank``, built on a fake group."""

    class _Mesh(DeviceMesh):  # building the cases reads only get_group()
        def __init__(self) -> None:
            pass

        def get_group(self, *args: object, **kwargs: object) -> dist.ProcessGroup:
            return FakeProcessGroup._create_internal(rank, 2)

    return every_bad_call(_Mesh(), rank)


def test_case_count_covers_the_brief() -> None:
    # The fully_shard-level, training-level and collective-level cases together.
    assert len(_local_cases()) >= 25


@pytest.mark.gloo
def test_every_rank_raises_before_any_collective_and_the_group_survives(gloo_results):
    for rank, result in enumerate(gloo_results):
        expected = _local_cases(rank)
        assert list(result["cases"]) == list(expected)
        for name, (kind, message, started, probe) in result["cases"].items():
            error, match, _ = expected[name]
            assert kind == error.__name__, f"rank {rank} {name}: raised {kind}: {message}"
            assert re.search(match, message), f"rank {rank} {name}: {message!r} !~ {match!r}"
            assert started == [], f"rank {rank} {name}: started {started} before raising"
            assert probe == [3.0, 30.0], f"rank {rank} {name}: all-reduce gave {probe}"
        assert comm.ALL_GATHER_C10D in result["valid_step_collectives"]  # the counter is live
        for got, want in zip(result["grads"], result["expected_grads"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gloo
def test_messages_are_identical_on_every_rank(gloo_results):
    # Collective-level messages name the rank they were built for; the rest must agree.
    per_rank = [{n: re.sub("0x[0-9a-f]+", "0x", m)
                 for n, (_, m, _, _) in r["cases"].items() if "rank=" not in m}
                for r in gloo_results]
    assert per_rank[0] == per_rank[1]


def test_errors_doc_tables_are_current() -> None:
    """The ``docs/errors.md`` tables are ``python -m tests.fsdp.bad_input_cases``'s output."""
    assert errors_table() in ERRORS_DOC.read_text()
