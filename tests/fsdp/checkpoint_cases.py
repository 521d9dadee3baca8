"""Rank-side bodies of the fully_shard checkpoint tests: state_dict and DCP, against FSDP2."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tests.fsdp.feature_cases import seeded_transformer
from tests.fsdp.parity_utils import batch, full_params, make_optimizer, shard_copies


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int,
          world_size: int) -> None:
    model.loss(*batch(step, rank, world_size)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """Every state entry of every parameter, in parameter order, as full tensors."""
    return [(key, _full(value)) for param in model.parameters()
            for key, value in sorted(optimizer.state[param].items())]


def _layout(state_dict: dict[str, Any]) -> dict[str, tuple]:
    return {
        key: (type(value).__name__, tuple(getattr(value, "placements", ())),
              tuple(value.to_local().shape if isinstance(value, DTensor) else value.shape),
              tuple(value.shape), value.dtype)
        for key, value in state_dict.items()
    }


def state_dict_round_trip(rank: int, world_size: int) -> dict[str, Any]:
    """Layout of ``state_dict()`` and ``load_state_dict`` of our own and of FSDP2's."""
    theirs, ours = shard_copies(seeded_transformer())
    optimizers = {id(m): make_optimizer("adamw", m.parameters()) for m in (theirs, ours)}
    for model in (theirs, ours):
        _step(model, optimizers[id(model)], 0, rank, world_size)
    result: dict[str, Any] = {
        "layout_theirs": _layout(theirs.state_dict()),
        "layout_ours": _layout(ours.state_dict()),
    }
    saved = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    saved_full = full_params(ours)
    _step(ours, optimizers[id(ours)], 1, rank, world_size)
    result["changed_by_step"] = full_params(ours)
    ours.load_state_dict(saved)
    result["saved"], result["reloaded"] = saved_full, full_params(ours)
    # FSDP2's state_dict loads into ours; the next steps must use the loaded values.
    _step(theirs, optimizers[id(theirs)], 1, rank, world_size)
    ours.load_state_dict(theirs.state_dict())
    for model in (theirs, ours):
        _step(model, optimizers[id(model)], 2, rank, world_size)
    result["after_load_theirs"], result["after_load_ours"] = full_params(theirs), full_params(ours)
    return result


def dcp_cross_load(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """DCP checkpoints of model + AdamW, saved by each library and loaded by the other."""
    trained = dict(zip(("theirs", "ours"), shard_copies(seeded_transformer())))
    fresh = dict(zip(("theirs", "ours"), shard_copies(seeded_transformer(seed=1))))
    optimizers = {id(m): make_optimizer("adamw", m.parameters())
                  for m in (*trained.values(), *fresh.values())}
    for name, model in trained.items():
        optimizer = optimizers[id(model)]
        for step in range(2):
            _step(model, optimizer, step, rank, world_size)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd},
                 checkpoint_id=os.path.join(directory, name))
    result: dict[str, Any] = {}
    for loader, saver in (("theirs", "ours"), ("ours", "theirs")):
        model, optimizer = fresh[loader], optimizers[id(fresh[loader])]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(directory, saver))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        source = trained[saver]
        result[f"{loader}_loads_{saver}"] = {
            "params": (full_params(source), full_params(model)),
            "optim": (optimizer_state(source, optimizers[id(source)]),
                      optimizer_state(model, optimizer)),
        }
    # Training continues identically from the loaded state.
    for model in (*trained.values(), *fresh.values()):
        _step(model, optimizers[id(model)], 2, rank, world_size)
    result["next_step"] = {name: (full_params(trained[saver]), full_params(fresh[name]))
                           for name, saver in (("theirs", "ours"), ("ours", "theirs"))}
    return result
