"""A ``fully_shard`` module's own forward as one call of a nested compile region.

[Note: forward regions]
In a whole step (``compile_step``: Dynamo traces ``backward()`` itself), L identical
blocks would be traced by Dynamo, AOTAutograd and Inductor L times. Instead, each
``FSDPModule.forward`` runs what lies between its all-gather and its release (the
module's own forward, over its unsharded parameters) through one
``torch.compiler.nested_compile_region`` function: Dynamo traces it for the first
block and stamps out the others, AOTAutograd traces its forward and backward once,
Inductor compiles it once. The collectives stay outside, in the step's graph: each
group's copy-in, all-gather and copy-out before the call, its reduce-scatter in the
backward of the all-gather, where Inductor's scheduling sees them next to the other
blocks'.

The region takes the unsharded parameters as explicit inputs (binding them to the
module inside), so they must not share storage: under regions the compiled copy-out
gives each parameter its own buffer (``collectives.ops``). Dynamo's own reuse check
refuses a region that binds (a side effect), so reuse goes by a key instead
(``reuse_hash_fn``): two calls share the traced region exactly when their keys are
equal. The key is a small int, one per distinct signature of

* the module tree's structure, read from the real modules while Dynamo traces
  (:func:`structure_key`): every submodule's class and training flag, its plain
  attributes by value (anything else by identity), its hooks by identity, its
  parameters' and buffers' layouts;
* the unsharded parameters' and the call's tensors' shape, stride, dtype, device and
  ``requires_grad`` (a tensor with symbolic sizes, under dynamic shapes, by its rank:
  hashing a symbolic size would specialize it), and the call's other arguments by
  value.

A module whose subtree holds another ``fully_shard`` module (its all-gather would run
inside the region), whose arguments hold anything but tensors and plain constants, or
which has inner forward hooks or a forward set on the instance runs its forward
inline, as without regions. torch's regions return tensors only, none of them an input;
the forward's output is rebuilt around the region (see [Note: region outputs]), so it may
hold tensors (the forward's own inputs among them), constants, and tuples, lists and
dicts of them. Anything else raises a ``TypeError`` naming the switch, and a view of an
input fails with torch's aliasing error, which ``compile_step`` names the switch in too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .. import _torch_patches
from ..tracing import constant_result, forward_regions_in_use, keyed_region, regions_available

__all__ = ["call_key", "forward_regions_in_use", "patch_torch", "region_of",
           "regions_available", "register"]

_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)

# The fully_shard modules by id: how the structure key, which Dynamo calls with
# constants only, finds the module it describes. Weak: it keeps no model alive.
_fsdp_modules: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()

# Structure, and call signature, -> small int, process-wide (a key is only compared
# within one trace; the dicts grow with the structures and signatures compiled).
_structure_ids: dict[tuple, int] = {}
_call_ids: dict[tuple, int] = {}


def register(module: nn.Module) -> None:
    """Records a ``fully_shard`` module for :func:`structure_key`."""
    _fsdp_modules[id(module)] = module


def _value_key(value: Any) -> Any:
    """``value`` by value where it is a plain constant or a container of them (a
    dict by its values: torch's hook dicts are keyed by per-module handle ids), else by
    identity (a function shared by every block is one object)."""
    if isinstance(value, _CONSTANT_TYPES):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((_value_key(v) for v in value), key=repr)))
    if isinstance(value, dict):
        return ("dict", tuple(_value_key(v) for v in value.values()))
    return ("id", id(value))


def _tensor_key(tensor: torch.Tensor) -> tuple:
    # A tensor with symbolic sizes keys by its rank: hashing a symbolic size would
    # specialize it (a recompile at the next size), and Dynamo offers no per-dim test.
    if tensor._has_symbolic_sizes_strides:
        layout: tuple = ("symbolic", tensor.dim())
    else:
        layout = (tuple(tensor.shape), tuple(tensor.stride()))
    return (*layout, tensor.dtype, tensor.device, tensor.requires_grad)


def _module_key(module: nn.Module) -> tuple:
    parts: list[Any] = [type(module), module.training]
    for name, value in vars(module).items():
        if name in ("_parameters", "_buffers", "_modules", "training") or name.startswith(
                ("_fsdp", "__composable_api_state_key")):
            continue
        parts.append((name, _value_key(value)))
    for name, param in module._parameters.items():
        parts.append(("param", name, None if param is None else (
            tuple(param.shape), param.dtype, param.requires_grad)))
    for name, buffer in module._buffers.items():
        parts.append(("buffer", name, None if buffer is None else _tensor_key(buffer)))
    return tuple(parts)


@constant_result
def structure_key(module_id: int) -> int | None:
    """A small int naming the structure of the module tree under the registered
    ``fully_shard`` module ``module_id``, or ``None`` when its forward must not run
    as a region (its subtree holds another ``fully_shard`` module). Runs in Python
    while Dynamo traces: it reads the real modules."""
    module = _fsdp_modules[module_id]
    parts = []
    for name, sub in module.named_modules():
        if sub is not module and _fsdp_modules.get(id(sub)) is sub:
            return None
        parts.append((name, _module_key(sub)))
    return _structure_ids.setdefault(tuple(parts), len(_structure_ids))


@constant_result
def _unsharded_key(module_id: int, grad_enabled: bool) -> tuple | None:
    """The layout of the unsharded parameters the registered ``fully_shard`` module
    ``module_id`` gathers, from its sharded parameters (``ParamShards.unsharded_layout_key``):
    a few Python lines instead of Dynamo tracing each tensor's key. Runs in Python while
    Dynamo traces; the parameters' own guards recompile where it would change."""
    return _fsdp_modules[module_id]._fsdp_group.params.unsharded_layout_key(grad_enabled)


@constant_result
def _key_id(signature: tuple, unsharded_count: int, arguments_layout: tuple) -> int:
    key = _call_ids.setdefault(signature, len(_call_ids))
    _call_layouts[key] = (unsharded_count, arguments_layout)
    return key


def call_key(module: nn.Module, unsharded: tuple[torch.Tensor, ...], args: tuple,
             kwargs: dict) -> tuple[int, tuple[torch.Tensor, ...]] | None:
    """The reuse key of one forward call (traced by Dynamo to a constant) and the
    call's flat input tensors (the parameters', then the arguments'), or ``None`` when
    it cannot run as a region (see [Note: region inputs])."""
    structure = structure_key(id(module))
    if structure is None:
        return None
    argument_tensors: list[torch.Tensor] = []
    unsupported: list[str] = []
    layout = _layout((args, kwargs), [], argument_tensors, unsupported)
    if unsupported:
        return None
    unsharded_key = _unsharded_key(id(module), torch.is_grad_enabled())
    if unsharded_key is None:
        unsharded_key = tuple(_tensor_key(t) for t in unsharded)
    signature = (structure, unsharded_key, layout,
                 tuple(_tensor_key(t) for t in argument_tensors))
    key = _key_id(signature, len(unsharded), layout)
    # ``+ 0``: a fresh constant. Dynamo gives the call's result a source it cannot guard
    # on, and the region's argument checks would try to.
    return key + 0, (*unsharded, *argument_tensors)


# [Note: region inputs]
# torch's regions take their arguments as a pytree, which Dynamo flattens with
# torch's pytree code on every call (a few thousand bytecodes per block), unless every
# argument is already a tensor, a constant or a module. So a region is called with
# the key, the module and one flat tuple of tensors: the unsharded parameters, then
# each distinct tensor of the forward's arguments. The arguments' layout (their
# containers and constants, which tensor goes where: the layout of [Note: region
# outputs]) is part of the key and recorded with it; the region's body rebuilds the
# arguments from it. Only tensors, plain constants, and tuples, lists and dicts of them
# have a layout: a forward called with anything else runs inline.
_call_layouts: dict[int, tuple[int, tuple]] = {}


@constant_result
def _recorded_call_layout(key: int) -> tuple[int, tuple]:
    return _call_layouts[key]


# [Note: region outputs]
# torch's regions return tensors only, none of them an input, and refuse reuse by key
# for anything else (a dict, a ``None`` in a tuple). The region returns the forward's
# output tensors as one flat tuple instead; the rest of the output, its layout (the
# containers, the constants, which leaf is a tensor it returns and which one of the
# call's own input tensors), is recorded by key while Dynamo traces the region's body,
# and read back after each call to build the output again. Equal keys trace equal
# bodies, so a stamped-out call reads the layout its traced call recorded.
_output_layouts: dict[int, tuple] = {}


def _layout(value: Any, inputs: list[torch.Tensor], returned: list[torch.Tensor],
            unsupported: list[str]) -> tuple:
    """The layout of ``value`` (a call's output, or its arguments with no ``inputs``),
    appending to ``returned`` the tensors the region returns for it, or takes (an input
    tensor, or one appended already, is referred to) and to ``unsupported`` the type
    of anything a layout cannot hold."""
    if isinstance(value, torch.Tensor):
        for i, tensor in enumerate(inputs):
            if value is tensor:
                return ("input", i)
        for i, tensor in enumerate(returned):
            if value is tensor:
                return ("tensor", i)
        returned.append(value)
        return ("tensor", len(returned) - 1)
    if isinstance(value, _CONSTANT_TYPES):
        # With its type: ``1``, ``1.0`` and ``True`` are equal keys, not equal arguments.
        return ("constant", (type(value).__name__, value))
    if type(value) in (tuple, list):
        return (type(value).__name__,
                tuple(_layout(item, inputs, returned, unsupported) for item in value))
    if type(value) is dict:
        return ("dict", tuple((key, _layout(item, inputs, returned, unsupported))
                              for key, item in value.items()))
    unsupported.append(type(value).__qualname__)
    return ("unsupported", None)


@constant_result
def _record_output_layout(key: int, layout: tuple, unsupported: tuple[str, ...]) -> int:
    """Runs in Python while Dynamo traces a region's body: keeps its output layout, or
    raises for the first type in ``unsupported``."""
    if unsupported:
        raise TypeError(
            f"with fsdp_traceable.config.forward_regions on (the default on torch 2.13+) "
            f"a fully_shard module's forward runs as a nested compile region, which "
            f"returns tensors, constants "
            f"and tuples, lists and dicts of them; this forward's output holds a "
            f"{unsupported[0]!r} object. Return those types, or set "
            f"fsdp_traceable.config.forward_regions = False"
        )
    _output_layouts[key] = layout
    return key


@constant_result
def _recorded_output_layout(key: int) -> tuple:
    return _output_layouts[key]


def _rebuild(layout: tuple, returned: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]
             ) -> Any:
    kind, content = layout
    if kind == "tensor":
        return returned[content]
    if kind == "input":
        return inputs[content]
    if kind == "constant":
        return content[1]
    if kind == "dict":
        return {key: _rebuild(item, returned, inputs) for key, item in content}
    items = [_rebuild(item, returned, inputs) for item in content]
    return tuple(items) if kind == "tuple" else items


def patch_torch() -> None:
    """See [Note: torch patches]: reused region calls' outputs connected to their
    inputs, and each call's schema built once, not by tracing the region again; where
    torch's regions take a reuse key (:func:`regions_available`). Applied by every
    ``fully_shard`` call (again: no change)."""
    if regions_available():
        _torch_patches.link_stamped_out_regions()
        _torch_patches.memoize_region_schemas()


def region_of(body: Callable[[nn.Module, tuple[torch.Tensor, ...], tuple, dict], Any]
              ) -> Callable[..., Any]:
    """``body(module, unsharded, args, kwargs)`` (which binds ``unsharded``, runs the
    module's forward and unbinds) as the shared region, called as
    ``region(call_key(module, unsharded, args, kwargs), module)``: calls with equal keys
    share one trace. Changes nothing of torch: a ``fully_shard`` call applies the
    patches the region needs (:func:`patch_torch`)."""

    def run_bound(key: int, module: nn.Module, *inputs: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
        # See [Note: region inputs] and [Note: region outputs].
        unsharded_count, arguments_layout = _recorded_call_layout(key)
        args, kwargs = _rebuild(arguments_layout, inputs[unsharded_count:], ())
        output = body(module, inputs[:unsharded_count], args, kwargs)
        returned: list[torch.Tensor] = []
        unsupported: list[str] = []
        layout = _layout(output, list(inputs), returned, unsupported)
        _record_output_layout(key, layout, tuple(unsupported))
        return tuple(returned)

    region = keyed_region(run_bound)

    def call(region_call: tuple[int, tuple[torch.Tensor, ...]], module: nn.Module) -> Any:
        key, inputs = region_call
        returned = region(key, module, *inputs)
        return _rebuild(_recorded_output_layout(key), returned, inputs)

    return call
