"""Rank bodies for ``compile_tests/test_step_cache.py``: a whole step saved by one run
and loaded by the next (each run new processes)."""

from __future__ import annotations

import pathlib
from typing import Any

import torch

import fsdp_traceable
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
from fsdp_traceable.testing import track_compiles

# One block: what is saved and loaded does not depend on depth, compile time does.
CONFIG = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8)


def train_both(rank: int, world_size: int, cache_dir: str) -> dict[str, dict[str, Any]]:
    """:func:`train` with the optimizer stepped after the compiled step (``"outside"``)
    and traced into it (``"in step"``), one rank run, one cache folder."""
    return {"outside": train(rank, world_size, cache_dir, optimizer_in_step=False),
            "in step": train(rank, world_size, cache_dir, optimizer_in_step=True)}


def train(rank: int, world_size: int, cache_dir: str, optimizer_in_step: bool = False
          ) -> dict[str, Any]:
    """Two SGD steps of a one-block transformer through ``compile_step(cache_dir=...)``;
    ``optimizer_in_step``: momentum SGD under a halving learning rate, traced into the
    step (``compile_step(optimizer=...)``)."""
    torch.manual_seed(0)
    model = shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1,
                                momentum=0.9 if optimizer_in_step else 0.0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model.loss(tokens, targets)
        loss.backward()
        return loss.detach()

    compiled = fsdp_traceable.compile_step(step, backend="aot_eager", cache_dir=cache_dir,
                                           optimizer=optimizer if optimizer_in_step else None)
    torch.manual_seed(rank)
    losses = []
    with track_compiles() as record:
        for _ in range(2):
            tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len))
            losses.append(compiled(tokens, torch.roll(tokens, 1, dims=1)))
            if not optimizer_in_step:
                optimizer.step()
                optimizer.zero_grad()
            schedule.step()
    return {
        "source": compiled.source,
        "path": str(compiled.path),
        "losses": torch.stack(losses),
        "frames": len(record.frames),
        "shards": [p.to_local().clone() for p in model.parameters()],
        "saved": sorted(p.name for p in pathlib.Path(cache_dir).iterdir()),
    }
