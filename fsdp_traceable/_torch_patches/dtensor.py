"""Patches of DTensor: its unflatten frame under Dynamo, and its strategy for an
unevenly sharded ``new_empty_strided``."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

# The patches applied so far in this process (torch's state is process-wide).
_applied: set[str] = set()


def skip_dtensor_unflatten_frames() -> bool:
    """Dynamo runs ``DTensor.__tensor_unflatten__`` eagerly when it is a frame of its own.

    A compiled backward returns the sharded gradients as plain tensors, and
    AOTAutograd's runtime wraps them back into DTensors with
    ``DTensor.__tensor_unflatten__``. When that backward runs inside a compiled
    function (``loss.backward()`` in a compiled train step, or compiled autograd's
    capture), Dynamo's frame callback is still active and compiles that frame on its
    own, which graph-breaks on the raw DTensor constructor. Running the frame eagerly
    is all the break falls back to; skipping it as a top-level frame removes the
    spurious breaks and leaves inlining it into a traced function as it was.

    Applies to: every torch with ``torch._dynamo.eval_frame.skip_code``; the break
    it avoids is present in 2.13 (the test checks the torch it runs on).

    Returns:
        Whether the frame is skipped (``False`` where torch has no ``skip_code``).
    """
    import torch._dynamo.eval_frame  # not on import: Dynamo takes about a second

    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip_code is None:
        return False
    if "skip_dtensor_unflatten_frames" not in _applied:
        skip_code(DTensor.__tensor_unflatten__.__code__)
        _applied.add("skip_dtensor_unflatten_frames")
    return True


def _shards_dim_0_only(spec: Any) -> bool:
    """Whether ``spec`` shards only tensor dim 0 (whose local stride is the global one)."""
    sharded = [p for p in spec.placements if p.is_shard()]
    return bool(sharded) and all(type(p) is Shard and p.dim == 0 for p in sharded)


def shard_uneven_new_empty_strided() -> bool:
    """DTensor's ``new_empty_strided`` keeps an unevenly sharded input's placement.

    Under compiled autograd, a parameter's first gradient is accumulated by
    ``grad.new_empty_strided(param.size(), param.stride()).copy_(grad)`` (autograd's
    gradient layout contract). Torch 2.11's DTensor lets that new tensor follow the
    gradient's sharding only if the size divides evenly over the mesh, else it is
    Replicate: the ``copy_`` all-gathers the sharded gradient and ``.grad`` becomes a
    full, replicated tensor (measured: one all-gather per unevenly sharded parameter in
    the compiled-autograd backward, ``.grad`` Replicate where FSDP2's is Shard(0)).
    Torch 2.13 lets it follow any sharding. Here it may follow a placement that shards
    tensor dim 0 only (fully_shard's default), whose local strides equal the global
    ones: the one case the uneven restriction need not cover.

    Applies to: torch whose ``new_factory_strategy`` still checks
    ``is_tensor_evenly_shardable`` (2.11; not 2.13, 2.14).

    Returns:
        Whether DTensor's strategy is patched (``False`` where torch has no restriction).
    """
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops import _tensor_ops

    factory = getattr(_tensor_ops, "new_factory_strategy", None)
    if factory is None or "is_tensor_evenly_shardable" not in factory.__code__.co_names:
        return False
    if "shard_uneven_new_empty_strided" in _applied:
        return True
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.new_empty_strided.default
    registered = propagator.op_strategy_funcs[op]

    @functools.wraps(registered)
    def strategy(op_schema: Any) -> Any:
        result = registered(op_schema)
        source = op_schema.args_schema[0]
        if not isinstance(source, OpStrategy) or tuple(source.shape) != tuple(op_schema.args_schema[1]):
            return result
        for source_spec in source.strategies:
            spec = source_spec.output_spec
            if _shards_dim_0_only(spec) and all(s.output_spec != spec for s in result.strategies):
                # Preferred over Replicate, as torch's own even-shard case.
                result.strategies.append(OpSpec(
                    output_specs=spec, input_specs=(spec,),
                    redistribute_cost=[[-0.1] * len(source.strategies)]))
        return result

    propagator.op_strategy_funcs[op] = strategy
    propagator.propagate_op_sharding.cache_clear()
    _applied.add("shard_uneven_new_empty_strided")
    return True
