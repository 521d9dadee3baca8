"""Synthetic token data with learnable structure, the same on every run."""

from __future__ import annotations

import torch


def synthetic_batch(
    step: int, rank: int, world_size: int, *, batch_size: int, seq_len: int, vocab_size: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(tokens, targets)`` for ``step``.

    Each sequence counts up with a per-sequence stride: ``t[i+1] = (t[i] + b) % vocab_size``
    with ``b`` in 1..4 and a random start, so a model that reads the context can predict
    every token after the first two, and the loss falls well below ``log(vocab_size)``.
    Targets are the tokens shifted by one.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * world_size + rank)
    stride = torch.randint(1, 5, (batch_size, 1), generator=generator)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
