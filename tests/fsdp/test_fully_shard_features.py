"""fully_shard features against torch's own FSDP2, on real gloo ranks, eager, bitwise.

Gradient accumulation (with and without gradient sync), HSDP, frozen parameters,
buffers, reshard modes and explicit unshard, tied weights, state_dict and DCP
checkpoints; and the training behaviours FSDP2's own test files check on accelerators
(gradient-norm clipping, mixed-precision dtypes and forward-input casts, structured
activations, unused outputs and modules, weights frozen inside a group, ``torch.func.jvp``
through sharded modules). The rank-side bodies are in ``feature_cases``,
``checkpoint_cases`` and ``training_behaviour_cases``; all 2-rank cases share one spawned
run, HSDP has its own 4-rank run. Bad arguments to ``fully_shard`` are checked in-process
on the fake process group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_traceable import FSDPModule, fully_shard
from fsdp_traceable.collectives.grad_dtypes import keeps_wider_grads
from fsdp_traceable.fsdp.arguments import ArgumentTypeError
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import (
    checkpoint_cases,
    feature_cases,
    registration_cases,
    training_behaviour_cases,
)
from tests.fsdp.feature_cases import (
    N_GROUPS,
    assert_bitwise,
    assert_same_training,
    case_results,
)


def _two_rank_cases(directory: str) -> list[tuple[str, Callable, tuple]]:
    return [
        ("grad_accumulation", feature_cases.grad_accumulation, ()),
        *((f"no_sync_{precision}", feature_cases.no_sync_accumulation, (precision,))
          for precision in feature_cases.NO_SYNC_POLICIES),
        ("frozen", feature_cases.frozen_params, ()),
        ("unused", feature_cases.unused_params, ()),
        ("buffers", feature_cases.buffers, ()),
        ("reshard_modes", feature_cases.reshard_modes, ()),
        ("unshard", feature_cases.unshard_and_reshard_after_backward, ()),
        ("tied_in_one_group", feature_cases.tied_in_one_group, ()),
        ("tied_across_groups", feature_cases.tied_across_groups, ()),
        ("embedding_own_group", feature_cases.embedding_own_group, ()),
        ("registered_params", registration_cases.registered_params, ()),
        ("state_dict", checkpoint_cases.state_dict_round_trip, ()),
        ("dcp", checkpoint_cases.dcp_cross_load, (directory,)),
        *((name, fn, ()) for name, fn in training_behaviour_cases.CASES),
    ]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("dcp"))
    return run_on_local_ranks(feature_cases.run_cases, 2, _two_rank_cases(directory))



@pytest.mark.gloo
def test_gradient_accumulation_over_microbatches_matches_fsdp2(two_ranks):
    for result in case_results(two_ranks, "grad_accumulation"):
        assert_same_training(result["theirs"], result["ours"])
        # Each microbatch gathers every group in forward and again in backward, the
        # root's embeddings too, whose backward reads no parameter (see [Note: the
        # re-gather at the backward's start]).
        steps, microbatches = 2, 3
        assert result["theirs_all_gathers"] == steps * microbatches * 2 * N_GROUPS
        assert result["ours_all_gathers"] == result["theirs_all_gathers"]


@pytest.mark.gloo
@pytest.mark.parametrize("precision", list(feature_cases.NO_SYNC_POLICIES))
def test_no_gradient_sync_until_last_microbatch_matches_fsdp2(two_ranks, precision: str):
    for result in case_results(two_ranks, f"no_sync_{precision}"):
        assert_same_training(result["theirs"], result["ours"])
        # Only the last microbatch of each of the 2 steps reduce-scatters, once per group.
        assert result["reduce_scatters"] == 2 * N_GROUPS
        assert result["grads_none_before_sync"] == [True, True]


@pytest.mark.gloo
@pytest.mark.slow
def test_hsdp_2x2_matches_fsdp2_hsdp():
    results = run_on_local_ranks(feature_cases.run_cases, 4, [("hsdp", feature_cases.hsdp, ())])
    for result in case_results(results, "hsdp"):
        assert_same_training(result["theirs"], result["ours"])
        for theirs_placements, ours_placements, theirs_local, ours_local in result["placements"]:
            assert ours_placements == theirs_placements
            assert theirs_placements[0] == Replicate()
            assert ours_local == theirs_local


@pytest.mark.gloo
def test_frozen_params_get_no_grad_stay_unchanged_rest_matches_fsdp2(two_ranks):
    for result in case_results(two_ranks, "frozen"):
        assert_same_training(result["theirs"], result["ours"])
        mask = result["frozen_mask"]
        assert any(mask) and not all(mask)
        for frozen, grad, initial, final in zip(
            mask, result["ours"]["grads"], result["initial"], result["ours"]["params"]
        ):
            assert (grad is None) == frozen
            if frozen:
                assert torch.equal(final, initial)
            else:
                assert not torch.equal(final, initial)
        # Block 1 (all frozen) still reshards after backward: 2 steps of 3 forward
        # gathers and 2 backward re-gathers.
        assert result["all_gathers"] == 2 * (N_GROUPS + N_GROUPS - 1)


@pytest.mark.gloo
def test_unused_params_keep_no_grad_and_match_fsdp2(two_ranks):
    for result in case_results(two_ranks, "unused"):
        assert sum(result["unused_mask"]) == 3
        for unused, grad in zip(result["unused_mask"], result["ours"]["grads"]):
            assert (grad is None) == unused
        assert_same_training(result["theirs"], result["ours"])


def test_buffers_untouched_by_sharding_and_used_in_forward(two_ranks):
    for result in case_results(two_ranks, "buffers"):
        assert_same_training(result["theirs"], result["ours"])
        assert result["names"]["ours"] == result["names"]["theirs"]
        assert result["state_dict_keys"]["ours"] == result["state_dict_keys"]["theirs"]
        assert "position_table" not in result["state_dict_keys"]["ours"]  # non-persistent
        assert all(t is torch.Tensor for t in result["buffer_types"])
        assert torch.equal(result["table_after_sharding"], result["initial_table"])
        assert_bitwise(result["final_buffers"]["theirs"], result["final_buffers"]["ours"],
                       "buffers after training")
        running_mean, updates = result["final_buffers"]["ours"][1:]
        assert updates.item() == 3 and running_mean.abs().sum() > 0


@pytest.mark.gloo
def test_reshard_after_forward_none_true_false_match_fsdp2_with_its_all_gathers(two_ranks):
    for result in case_results(two_ranks, "reshard_modes"):
        for reshard in (None, True, False):
            assert_same_training(result[f"theirs_reshard_{reshard}"],
                                 result[f"ours_reshard_{reshard}"])
            assert (result[f"ours_all_gathers_reshard_{reshard}"]
                    == result[f"theirs_all_gathers_reshard_{reshard}"])
        steps, blocks = 2, N_GROUPS - 1
        # None: blocks gather again in backward, the root does not; True on every
        # call, the root included (FSDP2 honours it), gathers every group again.
        assert result["ours_all_gathers_reshard_None"] == steps * (N_GROUPS + blocks)
        assert result["ours_all_gathers_reshard_True"] == steps * 2 * N_GROUPS
        assert result["ours_all_gathers_reshard_False"] == steps * N_GROUPS


@pytest.mark.gloo
def test_unshard_reshard_and_reshard_after_backward_match_fsdp2(two_ranks):
    for result in case_results(two_ranks, "unshard"):
        assert_bitwise(result["theirs"]["params"], result["ours"]["params"], "parameters")
        # After unshard() of every group, forward gathers nothing; the blocks reshard
        # after that forward and gather again in backward, as under FSDP2.
        assert result["ours"]["all_gathers_after_unshard"] == N_GROUPS - 1
        # Groups kept unsharded after the first microbatch's backward serve the second
        # microbatch's forward; the blocks reshard after it and gather in backward.
        first, second = result["ours"]["all_gathers_kept_after_backward"]
        assert first == N_GROUPS + (N_GROUPS - 1)
        assert second == N_GROUPS - 1
        for key in ("all_gathers_after_unshard", "all_gathers_kept_after_backward"):
            assert result["ours"][key] == result["theirs"][key]


@pytest.mark.gloo
def test_registered_params_follow_fsdp2_unsharded_while_unsharded(two_ranks):
    # named_parameters() at each point of a step: FSDP2's kinds (DTensor while sharded,
    # the unsharded plain tensors while unsharded), global shapes and full values.
    for result in case_results(two_ranks, "registered_params"):
        for reshard in registration_cases.RESHARD_AFTER_FORWARD:
            theirs, ours = result[f"theirs_{reshard}"], result[f"ours_{reshard}"]
            assert list(ours) == list(theirs)
            for point, snapshot in theirs.items():
                kinds = [entry[:3] for entry in ours[point]]
                assert kinds == [entry[:3] for entry in snapshot], (reshard, point)
                assert_bitwise([entry[3] for entry in snapshot],
                               [entry[3] for entry in ours[point]], f"{reshard} {point}")
            # Not vacuous: the last block is unsharded inside its forward, the root
            # (reshard_after_forward falsy by default) after it.
            assert not any(is_dtensor for name, is_dtensor, *_ in ours["inside_forward"]
                           if name.startswith("blocks.1."))
            assert any(not is_dtensor for _, is_dtensor, *_ in ours["after_forward"]) == (
                not reshard)


@pytest.mark.gloo
def test_tied_weights_in_one_group_match_fsdp2(two_ranks):
    for result in case_results(two_ranks, "tied_in_one_group"):
        assert result["tied"] == {"theirs": True, "ours": True}
        assert_same_training(result["theirs"], result["ours"])


@pytest.mark.gloo
def test_weight_shared_by_two_groups_raises_at_the_first_forward(two_ranks):
    for result in case_results(two_ranks, "tied_across_groups"):
        assert "'tok_embeddings.weight'" in result["root"]
        assert "'weight'" in result["embedding"]
        assert all("common ancestor" in message for message in result.values())


@pytest.mark.gloo
def test_group_not_regathered_in_backward_matches_fsdp2(two_ranks):
    # The embedding's backward needs no weight, so the backward prefetch of its group
    # is never used: it is finished when the backward ends, and the next forward gathers
    # the stepped weights.
    for result in case_results(two_ranks, "embedding_own_group"):
        assert_same_training(result["theirs"], result["ours"])
        assert result["ours"]["in_flight_after_backward"] == [False] * 3


@pytest.mark.gloo
def test_state_dict_layout_matches_fsdp2_and_round_trips(two_ranks):
    for result in case_results(two_ranks, "state_dict"):
        assert result["layout_ours"] == result["layout_theirs"]
        assert all(kind == "DTensor" for kind, *_ in result["layout_ours"].values())
        assert not all(torch.equal(a, b)
                       for a, b in zip(result["saved"], result["changed_by_step"]))
        assert_bitwise(result["saved"], result["reloaded"], "reloaded parameters")
        assert_bitwise(result["after_load_theirs"], result["after_load_ours"],
                       "parameters one step after loading FSDP2's state_dict")


@pytest.mark.gloo
def test_dcp_checkpoint_loads_across_libraries_bitwise(two_ranks):
    for result in case_results(two_ranks, "dcp"):
        for direction in ("theirs_loads_ours", "ours_loads_theirs"):
            source_params, loaded_params = result[direction]["params"]
            assert_bitwise(source_params, loaded_params, f"{direction} parameters")
            source_state, loaded_state = result[direction]["optim"]
            assert [k for k, _ in loaded_state] == [k for k, _ in source_state]
            assert {k for k, _ in source_state} == {"step", "exp_avg", "exp_avg_sq"}
            assert_bitwise([v for _, v in source_state], [v for _, v in loaded_state],
                           f"{direction} optimizer state")
        for name, (source, loaded) in result["next_step"].items():
            assert_bitwise(source, loaded, f"{name}: the step after loading")


# -- training behaviours FSDP2's own test files check on accelerators -----------------


@pytest.mark.gloo
def test_clip_grad_norm_on_sharded_grads_matches_fsdp2(two_ranks):
    for result in case_results(two_ranks, "clip_grad_norm"):
        for norm_type in training_behaviour_cases.NORM_TYPES:
            theirs, ours = result[f"theirs_{norm_type}"], result[f"ours_{norm_type}"]
            assert ours["total_norm"] > 0.05  # the clip is not vacuous
            assert torch.equal(ours["total_norm"], theirs["total_norm"])
            # The norm is a DTensor on the mesh: one all-reduce per mesh dim.
            assert ours["placements"] == theirs["placements"]
            assert ours["all_reduces"] == theirs["all_reduces"] == len(ours["placements"]) == 1
            assert_bitwise(theirs["clipped"], ours["clipped"], f"{norm_type}-norm clipped grads")
            assert_bitwise(theirs["params"], ours["params"], f"{norm_type}-norm stepped params")


REDUCE_DTYPES = {"bf16_compute": ["torch.bfloat16"], "bf16_compute_fp32_reduce": ["torch.float32"],
                 "fp32_compute_bf16_reduce": ["torch.bfloat16"], "fp16_compute": ["torch.float16"]}
if keeps_wider_grads():  # without reduce_dtype, FSDP2 reduces in the parameters' fp32
    REDUCE_DTYPES.update(bf16_compute=["torch.float32"], fp16_compute=["torch.float32"])


@pytest.mark.gloo
@pytest.mark.parametrize("combo", list(training_behaviour_cases.MP_COMBOS))
def test_mixed_precision_dtype_combination_matches_fsdp2(two_ranks, combo: str):
    # reduce_dtype defaults to param_dtype (from torch 2.15 to the parameters' dtype, see
    # [Note: wider gradient dtypes]); gradients land in the parameters' fp32.
    for result in case_results(two_ranks, "mixed_precision_dtypes"):
        theirs, ours = result[f"theirs_{combo}"], result[f"ours_{combo}"]
        assert_same_training(theirs, ours)
        assert ours["reduce_dtypes"] == theirs["reduce_dtypes"] == REDUCE_DTYPES[combo]
        assert all(g.dtype == torch.float32 for g in ours["grads"])


SEEN_DTYPES = {  # scenario -> dtype each module's forward received
    "low_precision_second": ("float32", "float32", "float16"),
    "second_casts_itself": ("float32", "float32", "float32"),
    "first_outputs_fp32": ("float32", "float16", "float32"),
    "root_bf16_casts_inputs": ("bfloat16", "bfloat16", "bfloat16"),
}


@pytest.mark.gloo
@pytest.mark.parametrize("scenario", list(training_behaviour_cases.CAST_SCENARIOS))
def test_cast_forward_inputs_and_output_dtype_match_fsdp2(two_ranks, scenario: str):
    for result in case_results(two_ranks, "forward_input_casts"):
        theirs, ours = result[f"theirs_{scenario}"], result[f"ours_{scenario}"]
        expected = dict(zip(("root", "first", "second"),
                            (f"torch.{d}" for d in SEEN_DTYPES[scenario])))
        assert ours["seen"] == theirs["seen"] == expected
        assert_same_training(theirs, ours)


@pytest.mark.gloo
def test_mixed_precision_details_match_fsdp2(two_ranks):
    for result in case_results(two_ranks, "mixed_precision_details"):
        runs = sorted({key.split("_", 1)[1] for key in result if key.startswith("ours_")})
        assert len(runs) == 8
        for run in runs:
            if f"theirs_{run}" not in result:  # FSDP2's own bug, see the case
                assert "grad_dtype" in result["fsdp2_frozen_first_forward_error"]
                continue
            assert_same_training(result[f"theirs_{run}"], result[f"ours_{run}"])
            for key in ("seen", "reduce_dtypes"):
                assert result[f"ours_{run}"].get(key) == result[f"theirs_{run}"].get(key), run
        ours = {run: result[f"ours_{run}"] for run in runs}
        assert all(g.dtype == torch.float32 for g in ours["frozen_first_forward"]["grads"])
        # A second input the caller makes is cast only if the submodule casts.
        assert ours["external_True"]["seen"] == {"x": "torch.bfloat16", "y": "torch.bfloat16"}
        assert ours["external_False"]["seen"] == {"x": "torch.bfloat16", "y": "torch.float32"}
        # The checkpoint's recompute (it stops once it has what backward saved) casts as
        # the forward did.
        in_bf16 = "in:torch.bfloat16"
        assert ours["checkpoint_input"]["seen"] == [in_bf16, "out:torch.bfloat16", in_bf16]
        assert ours["checkpoint_output"]["seen"] == [in_bf16, "out:torch.float32", in_bf16]
        assert ours["frozen_first_forward"]["reduce_dtypes"] == ["torch.float32"]


@pytest.mark.gloo
def test_structured_activations_between_groups_match_fsdp2(two_ranks):
    results = case_results(two_ranks, "structured_activations")
    for result in results:
        assert len(result) == len(training_behaviour_cases.CONTAINERS) + 2
        for run, trained in result.items():
            if "theirs" not in trained:  # FSDP2 before torch 2.13 fails on dataclasses
                assert all(math.isfinite(loss) for loss in trained["ours"]["losses"]), run
                continue
            assert trained["ours"]["losses"] == trained["theirs"]["losses"], run
            assert_same_training(trained["theirs"], trained["ours"])


@pytest.mark.gloo
def test_unused_forward_outputs_and_modules_match_fsdp2(two_ranks):
    for result in case_results(two_ranks, "unused_outputs_and_modules"):
        for run, trained in result.items():
            assert_same_training(trained["theirs"], trained["ours"])
            if run.startswith("unused_module"):  # ``second``'s weight and bias
                assert trained["ours"]["grads"][2:] == [None, None]


@pytest.mark.gloo
def test_weights_frozen_inside_groups_reduce_only_trainable_numel(two_ranks):
    for result in case_results(two_ranks, "frozen_weights_in_group"):
        for freeze_after in (False, True):
            theirs, ours = result[f"theirs_{freeze_after}"], result[f"ours_{freeze_after}"]
            assert_same_training(theirs, ours)
            # Each block's two biases (36 + 12), half per rank; the root has no parameters.
            assert ours["reduce_scatter_numels"] == theirs["reduce_scatter_numels"] == [24]
            assert ours["reduced_before_block0"] == theirs["reduced_before_block0"] == 2
            for grad, initial, final in zip(ours["grads"], ours["initial"], ours["params"]):
                assert (grad is None) == (final.dim() == 2)
                assert torch.equal(final, initial) == (final.dim() == 2)


@pytest.mark.gloo
def test_group_kept_unsharded_across_head_chunks_like_fsdp2(two_ranks):
    for result in case_results(two_ranks, "chunked_head_reshard_toggle"):
        for initial_reshard in (False, True):
            ours = result[f"ours_{initial_reshard}"]
            # sharded before the first step; each step: unsharded after both chunks,
            # sharded after the explicit reshard()
            assert ours["unsharded"] == [False] + [True, True, False] * 2
            if f"theirs_{initial_reshard}" in result:  # FSDP2 of torch 2.13+
                theirs = result[f"theirs_{initial_reshard}"]
                assert theirs["unsharded"] == ours["unsharded"]
                assert_same_training(theirs, ours)


@pytest.mark.gloo
def test_ddp_and_replicate_compose_with_sharded_modules_like_fsdp2(two_ranks):
    for result in case_results(two_ranks, "data_parallel_with_sharded_modules"):
        assert set(result) == {"ddp_around", "replicate_inside", "replicate_outside"}
        for layout, trained in result.items():
            assert_same_training(trained["theirs"], trained["ours"])


@pytest.mark.gloo
def test_jvp_through_sharded_modules_sees_constant_params_like_fsdp2(two_ranks):
    for result in case_results(two_ranks, "forward_mode_jvp"):
        for reshard in (False, True):
            ours = result[f"ours_{reshard}"]
            assert ours["output"].dtype == torch.bfloat16
            assert torch.count_nonzero(ours["tangent"]) == 0
            assert all(grad is not None for grad in ours["grads"])
            if f"theirs_{reshard}" in result:  # FSDP2 of torch 2.13+
                theirs = result[f"theirs_{reshard}"]
                assert_bitwise([theirs["output"]], [ours["output"]], "jvp output")
                assert_bitwise(theirs["grads"], ours["grads"], "gradients after the jvp")


# -- bad input, single process on the fake process group ------------------------------


class _TrainableFloat8(nn.Module):
    """A float8 parameter left trainable: its gradient has no dtype a backend reduces
    (frozen, it is sharded and gathered as FSDP2 does: tests/fsdp/test_frozen_dtypes.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, 4).to(torch.float8_e4m3fn))


# name -> (exception, regex, call(mesh, shard)); shard is the fully_shard under test
# (bad_input_cases runs each call on FSDP2's too, for docs/errors.md).
BAD_CALLS = {
    "applied_twice": (
        AssertionError, "only be applied to a module once.*already has it",
        lambda mesh, shard: shard(shard(nn.Linear(4, 4), mesh=mesh), mesh=mesh)),
    "three_d_mesh": (
        ValueError, "expects a 1D or 2D DeviceMesh.*3-D",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, 1, 1)))),
    "not_a_module": (
        ArgumentTypeError, "nn.Module", lambda mesh, shard: shard(torch.ones(4), mesh=mesh)),
    "trainable_float8_parameter": (
        TypeError, "parameter 'scale': requires_grad=True with dtype torch.float8_e4m3fn",
        lambda mesh, shard: shard(_TrainableFloat8(), mesh=mesh)),
    "placement_not_shard": (
        ValueError, "Invalid shard_placement_fn result: Replicate",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh,
                                  shard_placement_fn=lambda p: Replicate())),
    "uneven_shard_1": (
        NotImplementedError, "uneven sharding on dim 1: parameter 'weight'",
        lambda mesh, shard: shard(nn.Linear(3, 4), mesh=mesh,
                                  shard_placement_fn=lambda p: Shard(1))),
    "mp_policy_type": (
        TypeError, "mp_policy",
        lambda mesh, shard: shard(nn.Linear(4, 4), mesh=mesh,
                                  mp_policy={"param_dtype": torch.bfloat16})),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_to_fully_shard_raises(fake_mesh: DeviceMesh, name: str):
    error, message, call = BAD_CALLS[name]
    with pytest.raises(error, match=message):
        call(fake_mesh, fully_shard)


def test_rejected_module_is_left_unsharded(fake_mesh: DeviceMesh):
    module = nn.Linear(3, 4)
    with pytest.raises(NotImplementedError):
        fully_shard(module, mesh=fake_mesh, shard_placement_fn=lambda p: Shard(1))
    assert type(module) is nn.Linear and not isinstance(module, FSDPModule)
    assert all(type(p) is nn.Parameter and not hasattr(p, "placements")
               for p in module.parameters())
