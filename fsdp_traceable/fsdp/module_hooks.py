"""A user's forward hooks on a ``fully_shard``-ed module, run where FSDP2 runs them
relative to its unshard and reshard.

[Note: forward hook order]
FSDP2 registers its pre-forward (cast the inputs, unshard) as the module's first
forward pre-hook (``prepend=True``) and its post-forward (reshard, cast the output) as
a forward hook appended at ``fully_shard`` time. So, in FSDP2:

- forward pre-hooks registered before ``fully_shard``, and those registered after
  without ``prepend``, run after the unshard: they see the unsharded parameters and
  the cast inputs; a later ``prepend=True`` pre-hook runs before it;
- forward hooks registered before ``fully_shard``, and later ``prepend=True`` ones,
  run before the reshard; later ones without ``prepend`` run after it.

Ours unshards and reshards in ``FSDPModule.forward``, inside torch's hooks. The hooks
FSDP2 runs between its pair therefore live in :class:`InnerHooks` (``fully_shard``
moves the module's hook dicts there, so the handles a user already holds still remove
them; ``FSDPModule.register_forward_pre_hook`` / ``register_forward_hook`` add to them),
and ``FSDPModule.forward`` runs them after ``ParamGroup.pre_forward`` and before
``ParamGroup.post_forward``. torch's own dicts keep only the hooks that run outside.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

# nn.Module's dicts of forward hooks, and the InnerHooks field each moves to.
_MOVED = (
    ("_forward_pre_hooks", "pre"),
    ("_forward_pre_hooks_with_kwargs", "pre_kwargs"),
    ("_forward_hooks", "post"),
    ("_forward_hooks_with_kwargs", "post_kwargs"),
    ("_forward_hooks_always_called", "post_always"),
)


class InnerHooks:
    """The forward hooks a module runs between its group's pre- and post-forward.

    Fields as ``nn.Module``'s: ``pre``/``post`` map a handle id to a hook, the other
    three hold the ids registered ``with_kwargs`` / ``always_call``.
    """

    def __init__(self, module: nn.Module) -> None:
        """Takes over ``module``'s forward hook dicts (leaving it empty ones).

        Args:
            module: the module ``fully_shard`` is applied to.
        """
        for torch_name, name in _MOVED:
            setattr(self, name, module.__dict__[torch_name])
            module.__dict__[torch_name] = OrderedDict()

    def add_pre(self, hook: Callable[..., Any], with_kwargs: bool) -> RemovableHandle:
        """Registers a forward pre-hook that runs after the unshard (appended)."""
        handle = RemovableHandle(self.pre, extra_dict=self.pre_kwargs)
        self.pre[handle.id] = hook
        if with_kwargs:
            self.pre_kwargs[handle.id] = True
        return handle

    def add_post_first(self, hook: Callable[..., Any], with_kwargs: bool,
                       always_call: bool) -> RemovableHandle:
        """Registers a forward hook that runs first of all, before the reshard."""
        handle = RemovableHandle(self.post, extra_dict=[self.post_kwargs, self.post_always])
        self.post[handle.id] = hook
        self.post.move_to_end(handle.id, last=False)
        if with_kwargs:
            self.post_kwargs[handle.id] = True
        if always_call:
            self.post_always[handle.id] = True
        return handle

    def run_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Runs the pre-hooks as ``nn.Module.__call__`` does; returns the arguments."""
        for hook_id, hook in tuple(self.pre.items()):
            if hook_id in self.pre_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            "forward pre-hook must return None or a tuple of "
                            f"(new_args, new_kwargs), but got {result}."
                        )
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        return args, kwargs

    def run_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Runs the forward hooks as ``nn.Module.__call__`` does; returns the output."""
        for hook_id, hook in tuple(self.post.items()):
            if hook_id in self.post_kwargs:
                result = hook(module, args, kwargs, output)
            else:
                result = hook(module, args, output)
            if result is not None:
                output = result
        return output

    def run_always_called(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """After a forward that raised: the ``always_call`` hooks, their errors
        turned into warnings, as ``nn.Module.__call__`` does."""
        for hook_id, hook in tuple(self.post.items()):
            if hook_id not in self.post_always:
                continue
            try:
                if hook_id in self.post_kwargs:
                    hook(module, args, kwargs, None)
                else:
                    hook(module, args, None)
            except Exception as error:  # noqa: BLE001  (torch silences these too)
                warnings.warn(
                    "forward hook with ``always_call=True`` raised an exception that was "
                    f"silenced as another error was raised in forward: {error}",
                    stacklevel=2,
                )
