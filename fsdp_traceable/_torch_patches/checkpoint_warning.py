"""Torch's warning about ``checkpoint(context_fn=...)`` under compile, not logged for
this package's own recompute region."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from .wrapping import wrap_once

CONTEXT_FN_WARNING_LOGGER = "torch._higher_order_ops.wrap"
CONTEXT_FN_WARNING = (
    "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile"
)
QUIET_CONTEXT_FN = "_fsdp_traceable_quiet_context_fn"

_F = TypeVar("_F", bound=Callable[..., Any])


def quiet_context_fn(context_fn: _F) -> _F:
    """Marks a ``checkpoint(context_fn=...)`` of this package's as one whose region
    holds no in-place op, so torch's warning is not logged for it: see
    :func:`drop_context_fn_warning`."""
    setattr(context_fn, QUIET_CONTEXT_FN, True)
    return context_fn


def _checkpointed_context_fn(frame: Any) -> Any:
    """The ``context_fn`` of the checkpointed graph whose trace is in ``frame`` (torch's
    ``tag_activation_checkpoint_impl(gmod, ...)``), else ``None``."""
    meta = getattr(frame.f_locals.get("gmod"), "meta", None)
    return meta.get("_checkpoint_context_fn") if isinstance(meta, dict) else None


def drop_context_fn_warning() -> bool:
    """Torch's warning about ``checkpoint(..., context_fn=...)`` under compile is not
    logged for a ``context_fn`` marked :func:`quiet_context_fn`; every other region
    still logs it, as torch does.

    Passing ``context_fn`` makes torch log a warning asking that the region contain no
    in-place ops. It is logged when AOTAutograd traces the region, long after the
    package's code that called ``checkpoint`` returned (no context manager around
    that call can hold it), and through ``torch._logging.warning_once``, a
    ``functools.cache`` of ``(logger, message)``: logged once per process, so a
    logging filter that dropped the package's record would also leave a user's own
    selective checkpoint, compiled later, without its warning. Instead, the name
    ``warning_once`` in ``torch._higher_order_ops.wrap`` (only there) is wrapped: a
    call from the trace of a checkpointed graph whose ``context_fn`` is marked returns
    without logging (nor filling the cache); any other call is torch's own. Marked:
    the package's recompute-in-backward region (``fsdp/autograd_bridge.py``), the
    functional copy-in, all-gather and copy-out only.

    Applies to: every torch whose ``torch._higher_order_ops.wrap`` logs the warning
    through a module-level ``warning_once`` (2.13; ``tests/_torch_patches/test_checkpoint_warning.py``
    checks it on the torch it runs on, and where the name is missing nothing is
    changed).

    Returns:
        Whether the warning is skipped for marked regions (``False`` where torch has no
        such ``warning_once``).
    """
    try:
        from torch._higher_order_ops import wrap
    except ImportError:
        return False

    def skip_quiet_regions(current: Callable[..., Any]) -> Callable[..., Any]:
        def warning_once(logger_obj: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(_checkpointed_context_fn(sys._getframe(1)), QUIET_CONTEXT_FN, False):
                return None
            return current(logger_obj, *args, **kwargs)

        return warning_once

    return wrap_once(wrap, "warning_once", "_fsdp_traceable_skips_quiet", skip_quiet_regions)
