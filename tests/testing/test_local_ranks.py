"""How local ranks start: forked from the preloaded server while the caller's
environment and standard output match it, spawned otherwise, with the caller's
environment either way."""

from __future__ import annotations

import os

import pytest

from fsdp_traceable.testing.local_ranks import run_on_local_ranks

pytestmark = pytest.mark.gloo


def _parent_and_env(rank: int, world_size: int) -> tuple[int, str | None, str]:
    return os.getppid(), os.environ.get("FSDP_TRACEABLE_PROBE"), os.environ[
        "TORCHINDUCTOR_CACHE_DIR"]


def test_ranks_fork_from_the_server_and_spawn_when_the_environment_changed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    # what Inductor sets in a process once it loads compiled code: not a reason to spawn
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "140314929712160")
    (forked_parent, probe, cache_dir), = run_on_local_ranks(_parent_and_env, 1)
    assert forked_parent != os.getpid()  # the fork server's child
    assert probe is None
    # read at run time, so a changed value still forks, and the rank sees it
    assert cache_dir == str(tmp_path / "a" / "rank0")

    monkeypatch.setenv("FSDP_TRACEABLE_PROBE", "1")  # may be read at import: spawn
    (spawned_parent, probe, _), = run_on_local_ranks(_parent_and_env, 1)
    assert spawned_parent == os.getpid()
    assert probe == "1"


def _print_rank(rank: int, world_size: int) -> None:
    print(f"rank {rank} of {world_size} speaking")


def test_rank_output_reaches_the_callers_stdout(capfd):
    """A forked rank writes to the server's stdout: a captured stdout spawns instead."""
    run_on_local_ranks(_print_rank, 1)
    assert "rank 0 of 1 speaking" in capfd.readouterr().out


def _abort_in_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os.abort()


def test_a_rank_killed_by_a_signal_fails_the_call_with_its_python_stack():
    with pytest.raises(RuntimeError, match="SIGABRT") as info:
        run_on_local_ranks(_abort_in_rank_one, 2)
    assert "rank 1:" in str(info.value)
    assert "_abort_in_rank_one" in str(info.value)
