"""Buckets, special values and a bitwise comparison for the copy-kernel tests.

Ranks are simulated by slicing full tensors (``shard_tensor``); the reference for
every copy is the ``torch.ops.fsdp_traceable`` op on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_traceable.collectives.shard_info import make_shard_info, shard_tensor
from fsdp_traceable.sizes import flatten_sizes

NAN = float("nan")
INF = float("inf")
# fp32 values whose casts are easy to get wrong: NaN, infinities, signed zeros, fp32
# subnormals, fp16 overflow and its boundary (65520 rounds to inf, 65519.996 does not),
# fp16 subnormals and their ties (2^-25 rounds to 0, 1.5 * 2^-24 to 2^-23), fp32 max
# (bf16 inf), and ties of bf16 (1 + 2^-8) and fp16 (1 + 2^-11) in both directions.
F32_SPECIALS = [
    NAN, -NAN, INF, -INF, 0.0, -0.0, 1e-40, -1.4e-45, 65504.0, 65519.996, 65520.0,
    -65520.0, 1e5, -7e4, 6.103515625e-05, 6.097555160522461e-05, 5.960464477539063e-08,
    2.9802322387695312e-08, 2.9802326e-08, 8.940696716308594e-08, -3.0e-8,
    3.3895313892515355e38, 3.4028234663852886e38, 1.00390625, 1.01171875,
    1.00048828125, 1.00146484375, -1.00146484375,
]
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Param:
    size: tuple[int, ...]
    shard_dim: int = 0


def bucket(world_size: int) -> list[Param]:
    """Uneven ``Shard(0)`` (some ranks empty at 3 and 4 ranks), ``Shard(1)`` of a 3-D
    tensor (outer and inner dims > 1), an empty parameter, 1-D, and one parameter
    large enough to span several blocks."""
    del world_size  # every size below shards at 1 to 4 ranks
    return [
        Param((13, 5)), Param((7,)), Param((3, 12, 2), 1), Param((2,)), Param((0, 4)),
        Param((37, 3)), Param((4, 12), 1),
    ]


def full_tensors(params: list[Param], dtypes: list[torch.dtype], seed: int = 0) -> list[torch.Tensor]:
    """Random tensors whose first elements are :data:`F32_SPECIALS` (cast to ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    specials = torch.tensor(F32_SPECIALS)
    tensors = []
    for i, (param, dtype) in enumerate(zip(params, dtypes)):
        full = torch.randn(param.size, generator=gen) * 10.0 ** (i % 5 - 2)
        flat = full.view(-1)
        n = min(flat.numel(), specials.numel())
        flat[:n] = specials[(torch.arange(n) + i) % specials.numel()]
        tensors.append(full.to(dtype))
    return tensors


def rank_shards(
    params: list[Param], fulls: list[torch.Tensor], world_size: int, rank: int
) -> tuple[list[torch.Tensor], list[int]]:
    """One rank's shards of ``fulls`` and their padded numels."""
    infos = [make_shard_info(p.size, world_size, rank, shard_dim=p.shard_dim) for p in params]
    shards = [shard_tensor(f, info) for f, info in zip(fulls, infos)]
    return shards, [info.padded_sharded_numel for info in infos]


def copy_out_args(params: list[Param], world_size: int) -> tuple[list[int], list[int], list[int]]:
    """``(global_sizes_flat, ndims, shard_dims)`` of a bucket."""
    sizes_flat, ndims = flatten_sizes([p.size for p in params])
    return sizes_flat, ndims, [p.shard_dim for p in params]


def gathered(params: list[Param], fulls: list[torch.Tensor], world_size: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The all-gather output of a bucket: every rank's reference copy-in, concatenated."""
    inputs = []
    for rank in range(world_size):
        shards, padded = rank_shards(params, fulls, world_size, rank)
        inputs.append(torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, dtype))
    return torch.cat(inputs)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, nan_payloads: bool = False) -> None:
    """Bitwise equality. NaNs must sit at the same places; their sign and payload are
    compared only with ``nan_payloads`` (torch's own NaN encoding depends on the device
    and on whether its CPU kernel took the vectorised path)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    bits_a = actual.reshape(-1).view(_INT_OF_SIZE[actual.element_size()])
    bits_e = expected.reshape(-1).view(_INT_OF_SIZE[expected.element_size()])
    if actual.is_floating_point() and not nan_payloads:
        nan_a, nan_e = actual.reshape(-1).isnan(), expected.reshape(-1).isnan()
        assert torch.equal(nan_a, nan_e), "NaNs at different places"
        bits_a, bits_e = bits_a[~nan_a], bits_e[~nan_e]
    mismatch = (bits_a != bits_e).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} of {bits_a.numel()} elements differ; first at {mismatch[0].item()}: "
        f"{bits_a[mismatch[0]].item():#x} vs {bits_e[mismatch[0]].item():#x}"
    )

