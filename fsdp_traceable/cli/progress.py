"""What a command is doing, on standard error, with the seconds since it started.

A first compile runs for minutes on CPU and spawned ranks spend seconds importing
torch: without these lines a command prints nothing until its first step ends. Ranks
get the parent's start time as an argument (``started``), so every line counts from
the same moment. No torch here: :mod:`.main` imports this before the commands' modules.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["process_start_time", "say", "still_running"]


def process_start_time() -> float:
    """When this process started (``time.time()`` seconds), from ``/proc`` where there
    is one, so the first line's time includes the interpreter's imports; else now."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, after the parenthesized command name: start time in clock ticks
            # since boot.
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - max(0.0, age)


def say(message: str, started: float) -> None:
    """Prints ``[  12.3 s] message`` on standard error, counting from ``started``; under
    ``torchrun``, on rank 0 only (``RANK``), so one line stands for every rank."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"[{time.time() - started:7.1f} s] {message}", file=sys.stderr, flush=True)


@contextmanager
def still_running(what: str, started: float, every_s: float = 15.0) -> Iterator[None]:
    """While the body runs, says ``still <what> (N s)`` every ``every_s`` seconds.

    Args:
        what: what the body does, e.g. ``"compiling step 1"``.
        started: the command's start (:func:`say`'s clock).
        every_s: seconds between two lines; a body that ends sooner prints nothing.
    """
    done = threading.Event()
    began = time.time()

    def tick() -> None:
        while not done.wait(every_s):
            say(f"still {what} ({time.time() - began:.0f} s)", started)

    thread = threading.Thread(target=tick, name="fsdp_traceable-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
