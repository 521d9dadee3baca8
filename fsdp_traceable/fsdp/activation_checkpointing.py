"""Activation checkpointing around and inside ``fully_shard``-ed modules, eager.

[Note: activation checkpointing]
torch's non-reentrant checkpoint (``checkpoint_wrapper``, selective AC's ``context_fn``,
``torch.utils.checkpoint.checkpoint`` inside a forward) saves nothing of its region in
forward and runs the region again in backward, when autograd first unpacks one of the
region's saved tensors; the recomputed tensors only stand in for the saved ones, the
gradients still flow through the forward's graph. Two things follow for a group:

- The recompute may read the group's parameters without running the group's forward
  (the group's module is the checkpoint wrapper, or its forward calls ``checkpoint`` on
  a function): the parameter attribute then reads, while a backward runs, the
  parameters the group gathers for its backward (``ParamGroup.param_in_backward``),
  as FSDP2's pre-backward hook registers the unsharded parameters before the
  recompute. A group that keeps its forward parameters (``reshard_after_forward=False``)
  hands those over without an all-gather.
- The recompute may run the group's forward again (the group's module inside the
  region). The checkpoint counts the tensors its saved-tensor hooks see in forward and
  in the recompute, and refuses a mismatch, and only the innermost saved-tensor hooks
  see a save: so the group enters its own hooks (which swap saved unsharded parameters
  for tokens, see ``saved_unsharded``) only outside a checkpoint's hooks. Inside a
  checkpointed region every save then reaches the checkpoint, in forward and in the
  recompute alike, and the checkpoint drops the unsharded parameters with the rest of
  the region's activations; the recompute all-gathers them again. A forward running
  inside a backward also issues no forward prefetch: no next forward follows it.
- Compiled (``torch.compile``, ``compile_step``), Dynamo traces a checkpointed region as
  one higher-order op, which refuses any change of Python state in it. A group's traced
  forward inside one (a ``fully_shard``-ed module inside a ``checkpoint_wrapper``) binds
  its unsharded parameters to the module and unbinds them before it returns, and the
  compiled recompute re-gathers them from the graph's own all-gathers: nothing of that
  state is to be redone in backward. So the module a ``checkpoint_wrapper`` checkpoints
  is marked when it holds sharded modules, and Dynamo allows side effects in that
  checkpoint only (:func:`~fsdp_traceable._torch_patches.allow_checkpointed_group_state`).
  Such a group's forward is never a forward region: a region called inside a
  checkpointed region computed other numbers in a whole step (``compile_step``,
  ``aot_eager``) where the bound parameters give FSDP2's. A checkpoint of a plain
  function that calls a sharded module (``checkpoint(lambda x: block(x), x)``) is not
  marked: Dynamo refuses it, naming its global switch.
- Selective AC (a ``context_fn`` of ``create_selective_checkpoint_contexts``) records
  every op of the region in forward and looks each one up again, in order, in the
  recompute. The group's gathers differ between the two (forward may take a prefetched
  all-gather issued before the region, the recompute gathers inside it, and a read of
  the parameters by the recompute gathers them for backward), so they run with the
  selective-checkpoint modes set aside (:func:`outside_selective_checkpoint`): the
  region's record holds the module's compute only, in forward and in the recompute.
  Other dispatch modes (``CommDebugMode``, a fake mode) still see every op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from .._torch_patches import allow_checkpointed_group_state, allow_group_state_under_checkpoint

# The dispatch modes of selective AC: recording in forward, replaying in the recompute.
_SELECTIVE_CHECKPOINT_MODES = tuple(
    mode for mode in (getattr(torch_checkpoint, "_CachingTorchDispatchMode", None),
                      getattr(torch_checkpoint, "_CachedTorchDispatchMode", None))
    if mode is not None
)


def in_checkpointed_region() -> bool:
    """Whether the innermost saved-tensor hooks are a non-reentrant checkpoint's (its
    forward's or its recompute's)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and getattr(top[0], "__module__", None) == torch_checkpoint.__name__


@contextlib.contextmanager
def outside_selective_checkpoint() -> Iterator[None]:
    """Sets aside the selective-checkpoint dispatch modes on top of the mode stack
    while the block runs (see [Note: activation checkpointing])."""
    with contextlib.ExitStack() as stack:
        while isinstance(_get_current_dispatch_mode(), _SELECTIVE_CHECKPOINT_MODES):
            stack.enter_context(_pop_mode_temporarily())
        yield


def inside_checkpoint_wrappers(root: nn.Module, fsdp_module_cls: type) -> list[nn.Module]:
    """The ``fsdp_module_cls`` modules under ``root`` that sit inside a torch
    ``checkpoint_wrapper`` (other than the wrapper itself); marks the module each such
    wrapper checkpoints for Dynamo (see [Note: activation checkpointing])."""
    found: dict[int, nn.Module] = {}
    for wrapper in root.modules():
        if isinstance(wrapper, CheckpointWrapper):
            inside = [m for m in wrapper.modules()
                      if m is not wrapper and isinstance(m, fsdp_module_cls)]
            if inside:
                allow_checkpointed_group_state()
                allow_group_state_under_checkpoint(wrapper._checkpoint_wrapped_module)
            found.update((id(m), m) for m in inside)
    return list(found.values())
