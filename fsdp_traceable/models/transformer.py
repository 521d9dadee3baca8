"""A small decoder-only transformer: the built-in model for the demo, CLI and tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..sizes import round_up


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int | None = None  # default: 4 * dim * 2 / 3 rounded up to 8
    max_seq_len: int = 128

    @property
    def mlp_hidden_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        return round_up(int(8 * self.dim / 3), 8)


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        # Heads counted from the projection (-1): under tensor parallelism a rank holds
        # n_heads / tp of them (x itself is whole).
        q, k, v = (
            w(x).view(batch, seq, -1, dim // self.n_heads).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.mlp_hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.mlp_hidden_dim, bias=False)
        self.w2 = nn.Linear(config.mlp_hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TransformerStage(nn.Module):
    """One pipeline stage of a :class:`Transformer`: consecutive blocks, with the
    embeddings on the first stage and the final norm and output on the last.

    Args:
        model: the whole model; the stage takes its modules (not copies).
        stage_index: this stage's index, ``0 <= stage_index < n_stages``.
        n_stages: how many stages the blocks are split into (as evenly as they go,
            earlier stages one block more); at most the number of blocks.
    """

    def __init__(self, model: Transformer, stage_index: int, n_stages: int) -> None:
        super().__init__()
        n_layers = len(model.layers)
        if not 0 <= stage_index < n_stages <= n_layers:
            raise ValueError(f"stage {stage_index} of {n_stages}: needs 0 <= stage_index < "
                             f"n_stages <= the number of blocks ({n_layers})")
        per_stage, extra = divmod(n_layers, n_stages)
        start = stage_index * per_stage + min(stage_index, extra)
        end = start + per_stage + (stage_index < extra)
        self.is_first, self.is_last = stage_index == 0, stage_index == n_stages - 1
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.pos_embeddings = model.pos_embeddings if self.is_first else None
        self.layers = nn.ModuleList(model.layers[start:end])
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # h: the tokens
            positions = torch.arange(h.size(1), device=h.device)
            h = self.tok_embeddings(h) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.is_last else h


def shard_transformer(model: Transformer, fully_shard_fn, **kwargs) -> Transformer:
    """Applies ``fully_shard_fn`` (ours or torch's) per block, then to the root."""
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def check_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """Raises ``ValueError`` unless :func:`parallelize_transformer` can split a model of
    ``config`` over ``tp`` ranks (its heads and hidden features divide by ``tp``)."""
    for name, size in (("n_heads", config.n_heads), ("hidden size", config.mlp_hidden_dim)):
        if size % tp:
            raise ValueError(f"the transformer's {name} ({size}) must divide by the "
                             f"tensor-parallel degree ({tp})")


def parallelize_transformer(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Tensor parallelism on every block, torchtitan's plan for attention and the
    feed-forward: the q/k/v and w1/w3 projections column-wise (each rank a slice of the
    heads and of the hidden features), wo and w2 row-wise (their outputs all-reduced).
    Embeddings, norms and the output stay replicated. Apply before ``fully_shard`` on
    the data-parallel mesh.

    Args:
        model: the transformer; its ``n_heads`` and hidden size must divide by
            ``tp_mesh.size()``.
        tp_mesh: the 1-D tensor-parallel mesh.

    Returns:
        ``model``, parallelized in place.
    """
    check_tensor_parallel(model.config, tp_mesh.size())
    plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
    return model
