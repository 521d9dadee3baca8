"""A small set of kernel variants that covers every pair of argument choices.

Compiling all variants for every arch costs minutes on a small machine; most of an
arch's surprises (a branch that does not lower, a conversion the arch lacks) come with
one constexpr value or a pair of them. :func:`pairwise_sample` picks variants until
every pair of (argument, choice) values that occurs together in some variant occurs
together in a picked one, each constexpr value and pointer type/alignment included.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tests.triton_kernels.cuda_variants import KernelVariant

Choice = tuple[int, str]  # (argument index, the argument's constexpr value or type+attrs)


def choices(variant: KernelVariant) -> frozenset[Choice]:
    """What ``variant`` chose for each argument: its constexpr value, or its type with
    its specialization attributes (e.g. 16-byte divisibility)."""
    picked = set()
    for index, name in enumerate(variant.signature):
        if (index,) in variant.constexprs:
            picked.add((index, f"={variant.constexprs[(index,)]!r}"))
        else:
            picked.add((index, f"{variant.signature[name]}{variant.attrs.get((index,), '')}"))
    return frozenset(picked)


def _pairs(picked: frozenset[Choice]) -> set[tuple[Choice, Choice]]:
    return set(itertools.combinations(sorted(picked), 2))


def pairwise_sample(variants: Sequence[KernelVariant]) -> list[KernelVariant]:
    """A greedy pairwise covering of ``variants``, per kernel.

    Args:
        variants: the variants of one arch (several kernels allowed).

    Returns:
        A subset, in the input order, in which every pair of argument choices that
        occurs together in ``variants`` (for the same kernel) occurs together.
    """
    chosen: set[int] = set()
    for kernel in dict.fromkeys(v.kernel for v in variants):
        candidates = {i: _pairs(choices(v)) for i, v in enumerate(variants) if v.kernel == kernel}
        uncovered = set().union(*candidates.values())
        while uncovered:
            best = max(candidates, key=lambda i: (len(candidates[i] & uncovered), -i))
            uncovered -= candidates.pop(best)
            chosen.add(best)
    return [v for i, v in enumerate(variants) if i in chosen]
