"""The one way a patch replaces a function of torch (once, marked, torch's own kept), and
the switch a patch scoped to a block of code reads."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any


def wrap_once(owner: Any, name: str, marker: str,
              wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replaces ``owner.<name>`` with ``wrap(current)``, unless it is that wrapper already.

    The wrapper carries ``marker`` (so applying again changes nothing) and torch's own
    function as ``__wrapped__`` (what the ``test_torch_still_...`` checks call).

    Args:
        owner: the module or class holding the function.
        name: the function's name there.
        marker: the attribute marking this patch's wrapper.
        wrap: makes the wrapper from torch's function.

    Returns:
        Whether the wrapper is in place (``False`` where ``owner`` has no ``name``).
    """
    current = getattr(owner, name, None)
    if current is None:
        return False
    if getattr(current, marker, False):
        return True
    wrapper = functools.wraps(current)(wrap(current))
    setattr(wrapper, marker, True)
    setattr(owner, name, wrapper)
    return True


@contextlib.contextmanager
def switched_on(apply: Callable[[], bool], switch: contextvars.ContextVar[bool]) -> Iterator[bool]:
    """Within, ``switch`` is on, once ``apply()`` put the patch that reads it in place;
    yields whether it did (``False`` where torch has nothing to patch)."""
    if not apply():
        yield False
        return
    token = switch.set(True)
    try:
        yield True
    finally:
        switch.reset(token)
