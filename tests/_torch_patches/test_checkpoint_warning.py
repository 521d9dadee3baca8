"""The patch of ``fsdp_traceable/_torch_patches/checkpoint_warning.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import inspect
import logging

import torch
import torch.fx as fx

from fsdp_traceable import _torch_patches

# -- torch's context_fn warning, not logged for the package's own region ---------------

class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_torch_still_logs_the_context_fn_warning_once_per_process() -> None:
    # Logged once per process through a cached warning_once (so a logging filter that
    # dropped the package's record would use up a user's warning too), so read from the
    # source: the message, the logger, the function that logs it and its caller.
    module = torch._higher_order_ops.wrap
    assert module.__name__ == _torch_patches.CONTEXT_FN_WARNING_LOGGER
    assert module.log.name == _torch_patches.CONTEXT_FN_WARNING_LOGGER
    assert _torch_patches.CONTEXT_FN_WARNING in inspect.getsource(module.tag_activation_checkpoint_impl)
    assert "warning_once" in module.tag_activation_checkpoint_impl.__code__.co_names
    assert "gmod" in inspect.signature(module.tag_activation_checkpoint_impl).parameters
    torch_warning_once = module.warning_once
    if getattr(torch_warning_once, "_fsdp_traceable_skips_quiet", False):
        torch_warning_once = torch_warning_once.__wrapped__
    assert hasattr(torch_warning_once, "cache_info")  # functools.cache


def _log_from_a_checkpoint_trace(gmod: fx.GraphModule, message: str) -> None:
    """Logs ``message`` as ``tag_activation_checkpoint_impl(gmod, ...)`` does."""
    torch._higher_order_ops.wrap.warning_once(torch._higher_order_ops.wrap.log, message)


def test_context_fn_warning_skipped_for_marked_regions_only() -> None:
    module = torch._higher_order_ops.wrap
    assert _torch_patches.drop_context_fn_warning()
    patched = module.warning_once
    assert _torch_patches.drop_context_fn_warning()  # again: no change
    assert module.warning_once is patched

    @_torch_patches.quiet_context_fn
    def ours() -> None: ...

    def users() -> None: ...

    quiet, loud = (fx.GraphModule(torch.nn.Module(), fx.Graph()) for _ in range(2))
    quiet.meta["_checkpoint_context_fn"] = ours
    loud.meta["_checkpoint_context_fn"] = users
    # Messages of this test's own (torch's is logged once per process: not used up here).
    handler = _Keep()
    module.log.addHandler(handler)
    try:
        _log_from_a_checkpoint_trace(quiet, "fsdp_traceable test: a marked region")
        _log_from_a_checkpoint_trace(loud, "fsdp_traceable test: a user's region")
        module.warning_once(module.log, "fsdp_traceable test: no region")
        _log_from_a_checkpoint_trace(quiet, "fsdp_traceable test: a marked region")
        _log_from_a_checkpoint_trace(loud, "fsdp_traceable test: a user's region")  # once
    finally:
        module.log.removeHandler(handler)
    assert handler.messages == ["fsdp_traceable test: a user's region",
                                "fsdp_traceable test: no region"]
    # A user's region compiled after the package's: tests/test_import_side_effects.py.
