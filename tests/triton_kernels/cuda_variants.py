"""Every compiled variant of the copy kernels that the CUDA path can launch, derived
from the launch code itself.

A launch's inputs (destination kind, source kinds, pre-divide, tensor alignment,
sizes) go through the launcher's own argument builders
(:func:`~fsdp_traceable.triton_kernels.launch_args.pack_launch`,
:func:`~fsdp_traceable.triton_kernels.launch_args.unpack_launch`)
with stand-in tensors, then through Triton's own binder, which says what Triton
specializes on (argument types, 16-byte divisibility of pointers and of integers,
integers equal to 1). Distinct specializations are the variants. A constexpr or an
argument added to the launcher, or a specialization Triton adds, shows up here without
an edit. Torch-free: this runs where only ``triton`` is installed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from fsdp_traceable.triton_kernels.fields import (
    BYTES_DTYPE_NAME,
    DEFAULT_TILE,
    INT_NAME_OF_SIZE,
    KIND_BYTES,
    KIND_OF_DTYPE_NAME,
    MAX_INDEX,
)
from fsdp_traceable.triton_kernels.launch_args import (
    PACK_KERNEL,
    UNPACK_KERNEL,
    pack_launch,
    scale_for,
    unpack_launch,
)

# One integer of each class Triton tells apart (1, multiples of 16, the rest; the last
# at the int32 bound the layouts enforce: larger buckets take the aten path). 0 never
# reaches a launch: an empty bucket returns before it.
INT_SAMPLES = (1, 16, MAX_INDEX - DEFAULT_TILE)
ALIGNED_ADDRESS = 1 << 20
# Pre-divide factors a caller may pass (None: no divide).
PREDIVIDE_SAMPLES = (None, 3.0)
_DTYPE_OF_KIND = {kind: name for name, kind in KIND_OF_DTYPE_NAME.items()}
_DTYPE_OF_KIND[KIND_BYTES] = BYTES_DTYPE_NAME
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2,
             **{name: size for size, name in INT_NAME_OF_SIZE.items()}}


@dataclass(frozen=True)
class StandIn:
    """A tensor as Triton's binder sees it: a dtype name and an address."""

    dtype: str
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: what ``triton.compile`` needs, as the launcher would bind it.

    ``signature`` maps argument names to Triton types; ``constexprs`` and ``attrs`` are
    keyed by argument paths (``(index,)``), as ``triton.compiler.ASTSource`` takes them;
    ``options`` are the launch options (``num_warps``).
    """

    kernel: str
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]

    @property
    def key(self) -> str:
        """Identity of the compiled kernel (two launches with one key share a binary)."""
        return repr((self.kernel, self.signature, sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.items())))

    def label(self) -> str:
        """Readable name: runtime arguments with their types (``/16``: specialized as
        16-byte divisible), then the constexprs."""
        names = list(self.signature)
        parts = []
        for index, name in enumerate(names):
            if (index,) in self.constexprs:
                parts.append(f"{name}={self.constexprs[(index,)]}")
                continue
            divisible = any("divisibility" in str(a) for a in self.attrs.get((index,), ()))
            parts.append(f"{name}:{self.signature[name]}{'/16' if divisible else ''}")
        return f"{self.kernel}({', '.join(parts)}; num_warps={self.options.get('num_warps')})"


class Binder:
    """Binds launches to one kernel with Triton's own binder, as a launch does.

    Args:
        kernel: a ``@triton.jit`` function (compiled mode).
        backend: ``triton.compiler.make_backend(target)``.

    Raises:
        TypeError: this Triton lacks the binder API the check uses.
    """

    def __init__(self, kernel: Any, backend: Any) -> None:
        if not hasattr(kernel, "_pack_args"):
            raise TypeError("this Triton's JITFunction has no _pack_args; the check needs a "
                            "Triton whose JITFunction has it (3.4 to 3.9 do)")
        self.kernel = kernel
        self.backend = backend
        self._bind = create_function_from_signature(kernel.signature, kernel.params, backend)
        self._variants: dict[tuple, KernelVariant] = {}

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> KernelVariant:
        """The variant a launch with ``args`` and ``kwargs`` (tensors as
        :class:`StandIn`) compiles.

        Raises:
            TypeError: the arguments do not bind to the kernel's parameters.
            KeyError: a keyword is neither a parameter nor a launch option.
        """
        bound, specialization, options = self._bind(*args, **kwargs)
        key = (tuple(specialization), tuple(sorted(options.items())))
        variant = self._variants.get(key)
        if variant is None:
            _, signature, constexprs, attrs = self.kernel._pack_args(
                self.backend, kwargs, bound, specialization, options)
            launch_options = {k: v for k, v in kwargs.items() if k not in signature}
            variant = KernelVariant(self.kernel.__name__, dict(signature), dict(constexprs),
                                    dict(attrs), launch_options)
            self._variants[key] = variant
        return variant


def _addresses(dtype: str) -> tuple[int, int]:
    """An aligned and a misaligned address for a caller-provided tensor of ``dtype``."""
    return ALIGNED_ADDRESS, ALIGNED_ADDRESS + _ITEMSIZE[dtype]


def pack_launches() -> Iterator[tuple[tuple, dict[str, Any]]]:
    """Every ``pack_tiles`` launch the CUDA path can make, one per class of inputs.

    Sources and destinations of every kind ``fields`` names, every pre-divide CUDA
    uses, the output aligned or not (``all_gather_copy_in_into`` writes into a slice);
    the tables the launcher allocates itself are aligned. Combinations the launcher
    refuses (``ValueError``) are skipped.

    Returns:
        ``(args, kwargs)`` pairs as :func:`~fsdp_traceable.triton_kernels.launch_args.pack_launch`
        builds them.
    """
    kinds = [*KIND_OF_DTYPE_NAME.values(), KIND_BYTES]
    source_sets = [frozenset(c) for r in range(1, len(kinds) + 1)
                   for c in itertools.combinations(kinds, r)]
    scales = {scale_for(factor, "cuda") for factor in PREDIVIDE_SAMPLES}
    table64 = StandIn("int64", ALIGNED_ADDRESS)
    table32 = StandIn("int32", ALIGNED_ADDRESS)
    for dst_kind, src_kinds, (scale_mode, scale) in itertools.product(kinds, source_sets, scales):
        dtype = _DTYPE_OF_KIND[dst_kind]
        for address, *ints in itertools.product(_addresses(dtype), *[INT_SAMPLES] * 4):
            row_numel, tiles_per_row, num_tiles, world = ints
            try:
                yield pack_launch(
                    table64, StandIn(dtype, address), table64, table32, scale=scale,
                    row_numel=row_numel, tiles_per_row=tiles_per_row, num_tiles=num_tiles,
                    world=world, src_kinds=src_kinds, dst_kind=dst_kind, scale_mode=scale_mode,
                    interpret=False, tile=DEFAULT_TILE)
            except ValueError:
                break  # the launcher refuses these kinds whatever the sizes


def unpack_launches() -> Iterator[tuple[tuple, dict[str, Any]]]:
    """Every ``unpack_tiles`` launch the CUDA path can make: both buffers are integer
    views of one element size (``fields.INT_NAME_OF_SIZE``), each aligned or not.

    Returns:
        ``(args, kwargs)`` pairs as :func:`~fsdp_traceable.triton_kernels.launch_args.unpack_launch`
        builds them.
    """
    table64 = StandIn("int64", ALIGNED_ADDRESS)
    table32 = StandIn("int32", ALIGNED_ADDRESS)
    for dtype in INT_NAME_OF_SIZE.values():
        for source, target, *ints in itertools.product(
                _addresses(dtype), _addresses(dtype), *[INT_SAMPLES] * 4):
            row_numel, out_numel, num_tiles, world = ints
            yield unpack_launch(
                StandIn(dtype, source), StandIn(dtype, target), table64, table32,
                row_numel=row_numel, out_numel=out_numel, num_tiles=num_tiles, world=world,
                tile=DEFAULT_TILE)


def cuda_variants(kernels: ModuleType, arch: int) -> list[KernelVariant]:
    """The distinct compiled variants of ``kernels``' copy kernels for one CUDA arch.

    Args:
        kernels: ``kernels.py`` loaded in compiled mode (``loader.kernels_module(False)``).
        arch: compute capability as an int (80, 90, 100).

    Returns:
        The variants, pack kernels first, in a stable order.
    """
    backend = make_backend(GPUTarget("cuda", arch, 32))
    variants: dict[str, KernelVariant] = {}
    for name, launches in ((PACK_KERNEL, pack_launches()), (UNPACK_KERNEL, unpack_launches())):
        binder = Binder(getattr(kernels, name), backend)
        for args, kwargs in launches:
            variant = binder(args, kwargs)
            variants.setdefault(variant.key, variant)
    return list(variants.values())
