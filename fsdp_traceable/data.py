"""Synthetic token data with learnable structure, the same on every run."""

from __future__ import annotations

import torch


def synthetic_batch(
    step: int, rank: int, world_size: int, *, batch_size: int, seq_len: int, vocab_size: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(tokens, targets)`` for ``step``.

    Each sequence follows ``t[i+1] = (a * t[i] + b) % vocab_size`` with per-sequence
    random ``a``, ``b`` from a small set and a random start, so next-token loss can fall
    well below ``log(vocab_size)``; targets are the tokens shifted by one.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * world_size + rank)
    a = torch.randint(1, 4, (batch_size, 1), generator=generator)
    b = torch.randint(0, 7, (batch_size, 1), generator=generator)
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    for i in range(seq_len):
        tokens[:, i + 1] = (a[:, 0] * tokens[:, i] + b[:, 0]) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
