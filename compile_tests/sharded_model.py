"""The small fully_shard-ed transformer the compile tests share."""

from __future__ import annotations

import torch

import fsdp_traceable
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)

# Two blocks: three parameter groups (root, block 0, block 1). Sizes chosen so no
# activation has the shape of a block weight.
CONFIG = TransformerConfig(vocab_size=96, dim=48, n_layers=2, n_heads=4, hidden_dim=80,
                           max_seq_len=12)
N_GROUPS = CONFIG.n_layers + 1


def make_model(**fully_shard_kwargs) -> Transformer:
    """The transformer, sharded per block then at the root (on the current process group)."""
    torch.manual_seed(0)
    return shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard, **fully_shard_kwargs)


def data(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their targets."""
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.max_seq_len))
    return tokens, torch.roll(tokens, 1, dims=1)
