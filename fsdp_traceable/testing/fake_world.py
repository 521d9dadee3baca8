"""A single-process stand-in for the ranks: torch's fake process group (defined in
:mod:`fsdp_traceable.inspect.fake_world`, where ``explain`` compiles on it too)."""

from ..inspect.fake_world import fake_process_group

__all__ = ["fake_process_group"]
