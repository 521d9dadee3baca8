"""Torch's context_fn warning, which our recompute-in-backward region triggers under
torch.compile, is dropped; every other record of that logger still gets through."""

from __future__ import annotations

import logging

import fsdp_traceable  # noqa: F401  (installs the filter)


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_the_context_fn_warning_is_dropped() -> None:
    log = logging.getLogger("torch._higher_order_ops.wrap")
    handler = _Keep()
    log.addHandler(handler)
    try:
        log.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under "
                    "torch.compile.\nPlease make sure the checkpointed region does not "
                    "contain in-place ops (e.g. torch.relu_).\n")
        log.warning("another warning")
    finally:
        log.removeHandler(handler)
    assert handler.messages == ["another warning"]
