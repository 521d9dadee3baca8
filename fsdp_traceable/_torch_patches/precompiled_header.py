"""Patch of Inductor's C++ kernel loading: no precompiled header while a saved step loads."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable
from typing import Any

from .wrapping import switched_on, wrap_once

_skipped: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_traceable_header_precompile_skipped", default=False)


def skip_header_precompile_on_load() -> bool:
    """Inductor's precompile of the C++ kernels' common header returns no header inside
    :func:`header_precompile_skipped`.

    A new process loading C++ kernels (a saved step's) precompiles the common header
    (``cpp_prefix.h``) before looking for the first kernel's library: a preprocessor
    run and a checksum, up to a few tenths of a second of a restarted step's first call,
    and a whole header compile (about 6 s here) where the header directory, which lives
    under the temporary directory and not under ``TORCHINDUCTOR_CACHE_DIR``, is gone (a
    new container on a kept cache; see ``docs/benchmarks.md``). The library's key is
    computed before, from a command line that holds the header setting but not the
    header's path, so every library is found as without the patch; one that is missing
    is built without the precompiled header (each kernel includes the header itself),
    which only builds slower. Turning the setting off instead changes every key and rebuilds every kernel.

    Applies to: torch whose ``codecache`` has ``_precompile_header`` and computes the
    library's key before calling it (2.11 to 2.14; checked in the source).

    Returns:
        Whether the precompile is wrapped (``False`` where torch has none to wrap).
    """
    try:
        from torch._inductor import codecache
    except ImportError:
        return False
    if not hasattr(codecache, "_precompile_header") or not keys_libraries_before_header():
        return False

    def skip(current: Callable[..., Any]) -> Callable[..., Any]:
        def _precompile_header(*args: Any, **kwargs: Any) -> str | None:
            return None if _skipped.get() else current(*args, **kwargs)

        return _precompile_header

    return wrap_once(codecache, "_precompile_header", "_fsdp_traceable_skips", skip)


def keys_libraries_before_header() -> bool:
    """Whether torch's C++ kernel loader computes a library's key before it precompiles
    the header (so the header's path is not part of the key)."""
    from torch._inductor import codecache

    loader = getattr(getattr(codecache, "CppPythonBindingsCodeCache", None), "load_async", None)
    try:
        source = inspect.getsource(loader)
    except (OSError, TypeError):
        return False
    keyed, precompiled = source.find("key, main_path = write("), source.find("_precompile_header(")
    return 0 <= keyed < precompiled


def header_precompile_skipped() -> contextlib.AbstractContextManager[bool]:
    """Within, Inductor precompiles no C++ header (see
    :func:`skip_header_precompile_on_load`); yields whether it skips on this torch."""
    return switched_on(skip_header_precompile_on_load, _skipped)
