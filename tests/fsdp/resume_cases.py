"""Rank side of the checkpoint-resume tests: train, save with DCP, load, resume.

Three spawned runs share one checkpoint directory, in order: ``save_at_two_ranks``
(train ``STEPS`` steps, saving at step ``RESUME_AT``), ``reshard_at_four_ranks`` (load
that checkpoint at 4 ranks; train and save one of its own), ``resume_at_two_ranks``
(load the 4-rank checkpoint at 2 ranks; resume the 2-rank one to ``STEPS``; train
from scratch again). Every run returns full tensors, so the
parent test compares runs of different world sizes and processes bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_traceable import fully_shard
from fsdp_traceable.models.transformer import shard_transformer
from tests.fsdp.checkpoint_cases import optimizer_state
from tests.fsdp.feature_cases import seeded_transformer
from tests.fsdp.parity_utils import batch, full_params, make_optimizer

STEPS, RESUME_AT = 5, 2


def new_run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded transformer (blocks, then root) and its AdamW, from ``seed``."""
    model = shard_transformer(seeded_transformer(seed=seed), fully_shard)
    return model, make_optimizer("adamw", model.parameters())


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int, world_size: int,
) -> list[float]:
    """This rank's loss at each of ``steps`` (the step number picks the data)."""
    losses = []
    for step in steps:
        loss = model.loss(*batch(step, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full parameters and full AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``)."""
    return {"params": full_params(model), "optim": optimizer_state(model, optimizer)}


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _checkpoint(directory: str, world_size: int) -> str:
    return os.path.join(directory, f"saved_at_{world_size}_ranks")


def _load_fresh(
    path: str,
) -> tuple[dict[str, Any], dict[str, Any], nn.Module, torch.optim.Optimizer]:
    """(snapshot before loading, after loading, model, optimizer) of a run from another seed."""
    model, optimizer = new_run(seed=1)
    before = {"params": full_params(model)}
    load(model, optimizer, path)
    return before, snapshot(model, optimizer), model, optimizer


def save_at_two_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model, optimizer = new_run(seed=0)
    losses = train_steps(model, optimizer, range(RESUME_AT), rank, world_size)
    save(model, optimizer, _checkpoint(directory, world_size))
    saved = snapshot(model, optimizer)
    losses += train_steps(model, optimizer, range(RESUME_AT, STEPS), rank, world_size)
    before, loaded, _, _ = _load_fresh(_checkpoint(directory, world_size))
    return {"losses": losses, "saved": saved, "final": snapshot(model, optimizer),
            "before_load": before, "loaded": loaded}


def reshard_at_four_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    _, loaded_from_2, _, _ = _load_fresh(_checkpoint(directory, 2))
    model, optimizer = new_run(seed=0)
    train_steps(model, optimizer, range(RESUME_AT), rank, world_size)
    save(model, optimizer, _checkpoint(directory, world_size))
    return {"loaded_from_2": loaded_from_2, "saved": snapshot(model, optimizer)}


def resume_at_two_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    _, loaded_from_4, _, _ = _load_fresh(_checkpoint(directory, 4))
    _, _, model, optimizer = _load_fresh(_checkpoint(directory, world_size))
    resumed = train_steps(model, optimizer, range(RESUME_AT, STEPS), rank, world_size)
    result = {"loaded_from_4": loaded_from_4, "resumed_losses": resumed,
              "resumed_final": snapshot(model, optimizer)}
    model, optimizer = new_run(seed=0)
    result["rerun_losses"] = train_steps(model, optimizer, range(STEPS), rank, world_size)
    return result
