"""What the commands say while they work, and what they keep off standard error."""

from __future__ import annotations

import os
import re
import time

import torch

from fsdp_traceable.cli import memory
from fsdp_traceable.cli.arguments import TRAIN_MODES, TrainArgs
from fsdp_traceable.cli.progress import process_start_time, say, still_running
from fsdp_traceable.cli.train import first_step_description


def test_say_counts_seconds_from_the_start(capsys) -> None:
    say("spawning 2 ranks", time.time() - 12.3)
    assert re.fullmatch(r"\[ +12\.\d s\] spawning 2 ranks\n", capsys.readouterr().err)


def test_process_start_time_is_before_now() -> None:
    assert 0 <= time.time() - process_start_time() < 24 * 3600


def test_still_running_ticks_while_the_body_runs(capsys) -> None:
    with still_running("compiling step 1", time.time(), every_s=0.05):
        time.sleep(0.3)
    ticks = capsys.readouterr().err.splitlines()
    assert len(ticks) >= 2 and all("still compiling step 1 (" in line for line in ticks)
    with still_running("compiling step 1", time.time(), every_s=60):
        pass
    assert capsys.readouterr().err == ""


def test_first_step_says_what_it_compiles() -> None:
    for mode in TRAIN_MODES:
        description = first_step_description(TrainArgs(mode=mode, backend="aot_eager"))
        assert description.startswith("step 1")
        assert ("compiles" in description and "aot_eager" in description) == (mode != "eager")


def test_profiler_start_and_stop_marks_stay_off_stderr(capfd) -> None:
    assert memory.peak_allocated_bytes(lambda: torch.ones(1000) + 1) > 0
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    # Only kineto's marks are dropped: other writes to file descriptor 2 meanwhile stay.
    with memory._without_kineto_marks():
        os.write(2, b"USDT:2026-12-06 02:20:01 5117:5117 SyncActivityProfilerHandler.cpp:52] "
                    b"profiler_start\nsomething else\n")
    assert capfd.readouterr().err == "something else\n"
