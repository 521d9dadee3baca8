"""Patch of Inductor's CPU vector ISA probe: its child-process load checks answered
from a saved outcome."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable
from typing import Any

from .wrapping import switched_on, wrap_once

_loads_answered: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_traceable_isa_loads_answered", default=False)


def answer_isa_load_checks() -> bool:
    """Inductor's load check of an ISA test library answers yes inside
    :func:`isa_load_checks_answered`.

    Deciding whether the host runs a vector ISA's extensions (AVX-512 BF16, VNNI,
    AMX), Inductor builds a test library for each (cached on disk) and loads it in a
    child Python process (``VecISA._probe_load``), even with ``config.cpp.vec_isa_ok``
    set: three children on an AVX-512 BF16 + VNNI host, about 0.1 s of the 1 s a
    restarted process's first call of a saved 4-block step took. The loading process
    of a saved step whose saving process, on a CPU advertising the same instruction
    sets, found every one of them loadable, answers those checks from that outcome
    (``fsdp_traceable/whole_step/cpu_isa_probe.py``); every other call loads as torch does.

    Applies to: torch 2.13, whose ``VecISA`` has ``_probe_load`` and keeps no outcome
    of it (2.14 marks a loaded library on disk and loads it once per cache directory;
    2.11 checks inside ``check_build``; nothing is changed there).

    Returns:
        Whether the check is wrapped (``False`` where torch has none to wrap).
    """
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return False
    if not hasattr(VecISA, "_probe_load") or _records_loads(VecISA):
        return False

    def answer(current: Callable[..., Any]) -> Callable[..., Any]:
        def _probe_load(self: Any, output_path: str) -> bool:
            return True if _loads_answered.get() else current(self, output_path)

        return _probe_load

    return wrap_once(VecISA, "_probe_load", "_fsdp_traceable_answers", answer)


def _records_loads(vec_isa_class: type) -> bool:
    """Whether torch keeps each load check's outcome on disk itself (a ``.load_ok``
    marker next to the library, torch 2.14)."""
    try:
        return ".load_ok" in inspect.getsource(vec_isa_class.check_build)
    except (OSError, TypeError):
        return False


def isa_load_checks_answered() -> contextlib.AbstractContextManager[bool]:
    """Within, Inductor's ISA load checks answer yes (see
    :func:`answer_isa_load_checks`); yields whether they do on this torch."""
    return switched_on(answer_isa_load_checks, _loads_answered)
