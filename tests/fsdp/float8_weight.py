"""A float8-style weight for the all-gather extension tests, after torchao's
``WeightWithDynamicFloat8CastTensor``: a wrapper subclass around a high-precision
tensor whose FSDP hooks all-gather 1-byte ``float8_e4m3fn`` data plus an fp32 scale
(the max-abs is all-reduced over the shard mesh, so every rank uses one scale) and
rebuild the weight in the compute dtype."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

FLOAT8_MAX = torch.finfo(torch.float8_e4m3fn).max

aten = torch.ops.aten
# FSDP pads, slices, copies and views the local tensor: those keep the subclass.
_PRESERVED_OPS = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.slice.Tensor, aten.split.Tensor, aten.clone.default, aten.copy_.default,
    aten.new_zeros.default, aten.empty_like.default, aten._to_copy.default,
    aten.as_strided.default, aten._pin_memory.default,
}


class WrappedWeight(torch.Tensor):
    """A wrapper subclass around a high-precision tensor, without FSDP hooks."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> WrappedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], type(self)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, subclass, outer_size, outer_stride):
        return subclass(inner_tensors["_tensor"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor})"


class Float8CastWeight(WrappedWeight):
    """A high-precision weight that FSDP all-gathers in float8."""

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        hp = self._tensor
        padded_rows = -(-outer_size[0] // mesh.size())
        if hp.size(0) != padded_rows:
            hp = torch.cat([hp, hp.new_zeros(padded_rows - hp.size(0), *hp.shape[1:])])
        amax = funcol.all_reduce(hp.abs().amax().float(), "max", mesh)
        scale = FLOAT8_MAX / torch.clamp(amax, min=1e-12)
        data = (hp.float() * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
        return (data,), (scale,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple[torch.Tensor, ...],
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        (data,) = all_gather_outputs
        (scale,) = metadata
        weight = (data.float() / scale).to(param_dtype)
        if out is not None:
            # FSDP2's unsharded parameter from an earlier all-gather, which autograd may
            # have saved: refilled (its kept rows of the padded weight) without a
            # version bump, as FSDP2's own copy-out does.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight[: out.size(0)])
            return None
        return weight, (weight,)


class Float8MLP(nn.Module):
    """Three linears with uneven row counts at 2 ranks: two with a float8 weight and a
    plain bias (mixed-dtype buckets), and an ordinary one.

    Args:
        float8_only_bucket: drop the second linear's bias, so its group all-gathers
            float8 data alone (gloo has no float8 all-gather: FSDP2's default fails).
    """

    def __init__(self, float8_only_bucket: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(16, 13)
        self.second = nn.Linear(13, 9, bias=not float8_only_bucket)
        self.ordinary = nn.Linear(9, 5)
        for linear in (self.first, self.second):
            linear.weight = nn.Parameter(Float8CastWeight(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        x = torch.relu(self.second(x))
        return self.ordinary(x)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(x), target)


def shard_float8_mlp(model: Float8MLP, fully_shard_fn, **kwargs) -> Float8MLP:
    """``fully_shard`` per linear, then the root, with either library."""
    for linear in (model.first, model.second, model.ordinary):
        fully_shard_fn(linear, **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision data of ``tensor`` (a DTensor's local shard, unwrapped)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return (local._tensor if isinstance(local, WrappedWeight) else local).detach().clone()
