"""``compile_step(cache_dir=...)``: a restarted process loads the saved whole step and
trains on without compiling; ranks agree on loading or compiling; a changed model or
setting is a miss, never a stale graph."""

from __future__ import annotations

import pathlib

import pytest
import torch

import fsdp_traceable
from compile_tests.sharded_model import data, make_model
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors
from fsdp_traceable.whole_step.step_cache import _closure_modules, fingerprint, precompile_available

needs_precompile = pytest.mark.skipif(
    not (dynamo_traces_backward_into_dtensors() and precompile_available()),
    reason="this torch cannot compile a whole step ahead of time (2.12+)")


@needs_precompile
@pytest.mark.gloo
def test_a_restarted_process_loads_the_saved_step_and_ranks_agree(tmp_path: pathlib.Path) -> None:
    from compile_tests import step_cache_cases

    # Each run trains two steps: the optimizer stepped after the compiled step, and
    # traced into it (the optimizer handed in at load like the model).
    cache_dir = str(tmp_path)
    first = run_on_local_ranks(step_cache_cases.train_both, 2, cache_dir)
    for kind in ("outside", "in step"):
        assert [r[kind]["source"] for r in first] == ["compiled", "compiled"], kind
    # One file per rank and step, and its inlined sources' checksums (and, where the
    # rank ran Inductor's CPU vector ISA probe, that probe's outcome: see cpu_isa_probe).
    steps = [name for name in first[0]["in step"]["saved"] if not name.endswith(".isa.json")]
    assert len({r[kind]["path"] for r in first for kind in r}) == 4 and len(steps) == 8

    # Rank 1's files are damaged: rank 0 could load, but both compile (rank 1 saves again).
    for kind in ("outside", "in step"):
        pathlib.Path(first[1][kind]["path"]).write_bytes(b"not a saved step")
    again = run_on_local_ranks(step_cache_cases.train_both, 2, cache_dir)
    for kind in ("outside", "in step"):
        assert [r[kind]["source"] for r in again] == ["compiled", "compiled"], kind

    restarted = run_on_local_ranks(step_cache_cases.train_both, 2, cache_dir)
    for kind in ("outside", "in step"):
        assert [r[kind]["source"] for r in restarted] == ["loaded", "loaded"], kind
        assert [r[kind]["frames"] for r in restarted] == [0, 0], kind  # nothing compiled
        for before, after in zip(first, restarted):
            assert torch.equal(before[kind]["losses"], after[kind]["losses"]), kind
            for a, b in zip(before[kind]["shards"], after[kind]["shards"]):
                assert torch.equal(a, b), kind


@needs_precompile
def test_fingerprint_follows_what_the_dropped_guards_stood_for(fake_world: None) -> None:
    # The saved step keeps only its arguments' guards: the key must change with the
    # model's layout and its groups' settings, and not between identical models.
    def key_of(model: torch.nn.Module) -> str:
        def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return model.loss(tokens, targets)

        return fingerprint(step, _closure_modules(step), data(), {})

    base = key_of(make_model())
    assert key_of(make_model()) == base
    changed = make_model()
    changed.layers[0].set_reshard_after_backward(False, recurse=False)
    assert key_of(changed) != base
    assert key_of(make_model(reshard_after_forward=False)) != base


@needs_precompile
def test_compile_step_refuses_a_guard_filter_with_cache_dir(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="guard_filter_fn"):
        fsdp_traceable.compile_step(lambda x: x, cache_dir=tmp_path,
                                    options={"guard_filter_fn": lambda entries: entries})
