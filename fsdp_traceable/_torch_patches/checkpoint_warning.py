"""The one torch warning about ``checkpoint(context_fn=...)`` under compile, dropped."""

from __future__ import annotations

import logging

CONTEXT_FN_WARNING_LOGGER = "torch._higher_order_ops.wrap"
CONTEXT_FN_WARNING = (
    "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile"
)


def _keep_unless_context_fn_warning(record: logging.LogRecord) -> bool:
    return CONTEXT_FN_WARNING not in record.getMessage()


def drop_context_fn_warning() -> bool:
    """Torch's warning about ``checkpoint(..., context_fn=...)`` under compile is dropped.

    Passing ``context_fn`` makes torch log a warning (once, when AOTAutograd traces the
    region, so no context manager around the call can hold it) asking that the region
    contain no in-place ops; safe to drop: the package's recompute-in-backward region
    (``fsdp/autograd_bridge.py``) is the functional copy-in, all-gather and copy-out
    only. The filter matches that one message on the one logger that emits it; every
    other record of that logger gets through.

    Applies to: every torch (a logging filter); torch 2.13's
    ``torch._higher_order_ops.wrap`` emits the warning (the test checks the torch it
    runs on).

    Returns:
        ``True``.
    """
    logger = logging.getLogger(CONTEXT_FN_WARNING_LOGGER)
    if _keep_unless_context_fn_warning not in logger.filters:
        logger.addFilter(_keep_unless_context_fn_warning)
    return True
