"""Rank-side bodies of the FSDP2 parity tests for fully_shard's arguments, meta-device
init, torch's ``FSDPModule`` surface and the unshard life cycle.

Each case takes ``(rank, world_size, ...)``, builds one model, shards a copy with each
library (torch's FSDP2 first), drives both through the same calls on the same data and
returns plain results for the parent test; :func:`~tests.fsdp.feature_cases.run_cases`
runs a list of them on every rank.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, register_fsdp_forward_method
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import Shard

import fsdp_traceable
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)
from tests.fsdp.feature_cases import record_all_gathers
from tests.fsdp.parity_utils import (
    backward_context,
    batch,
    compile_backend,
    full_params,
    loss_fn,
    make_optimizer,
)

# Uneven shards at 2 and 3 ranks: 71 vocabulary rows, 17 positions, 51 hidden rows.
UNEVEN = TransformerConfig(vocab_size=71, dim=36, n_layers=2, n_heads=4, hidden_dim=51,
                           max_seq_len=17)
LIBRARIES = (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard))

ShardFn = Callable[..., nn.Module]


def titan_shard(model: Transformer, fully_shard_fn: Callable, **kwargs: Any) -> Transformer:
    """torchtitan's recipe: each block, then ``[norm, output]`` as one group, then the root."""
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn([model.norm, model.output], **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def train_modes(
    base: nn.Module,
    rank: int,
    world_size: int,
    shard_fn: ShardFn,
    mode: str = "eager",
    steps: int = 3,
    **shard_kwargs: Any,
) -> dict[str, Any]:
    """Trains FSDP2 eagerly and ours in ``mode`` (``eager``, ``compile-ca``), AdamW.

    Args:
        base: the unsharded model (left untouched).
        rank, world_size: choose the data.
        shard_fn: ``shard_fn(model, fully_shard_fn, **shard_kwargs)``.
        mode: how ours runs; FSDP2 always runs eagerly.
        steps: optimizer steps.
        shard_kwargs: passed to both libraries' ``fully_shard``.

    Returns:
        ``{"theirs": ..., "ours": ...}``, each with ``losses``, ``params`` (full),
        ``locals`` (this rank's shards) and ``grads`` (this rank's first-step local grads).
    """
    result = {}
    for name, fully_shard_fn in LIBRARIES:
        model = shard_fn(copy.deepcopy(base), fully_shard_fn, **shard_kwargs)
        result[name] = run_steps(model, rank, world_size, mode if name == "ours" else "eager",
                                 steps)
    return result


def run_steps(model: nn.Module, rank: int, world_size: int, mode: str, steps: int,
              config: TransformerConfig = UNEVEN, backward_backend=None) -> dict[str, Any]:
    """``steps`` AdamW steps of ``model.loss`` in ``mode``; see :func:`train_modes`.
    ``backward_backend``: compiled autograd's backend, for its modes. The ``whole-step``
    modes compile forward and backward as one graph (:func:`fsdp_traceable.compile_step`)."""
    optimizer = make_optimizer("adamw", model.parameters())
    whole_step = None
    if mode.startswith("whole-step"):
        def train_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = model.loss(tokens, targets)
            loss.backward()
            return loss.detach()

        whole_step = fsdp_traceable.compile_step(train_step, backend=compile_backend(mode))
    compute_loss = loss_fn(model, mode) if whole_step is None else None
    backward_ctx = backward_context(mode, backward_backend)
    losses, grads = [], None
    for step in range(steps):
        if whole_step is not None:
            loss = whole_step(*batch(step, rank, world_size, config))
        else:
            loss = compute_loss(*batch(step, rank, world_size, config))
            with backward_ctx():
                loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": full_params(model), "grads": grads,
            "locals": [_local(p).detach().clone() for p in model.parameters()]}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def uneven_transformer(seed: int = 0, config: TransformerConfig = UNEVEN) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config)


# -- fully_shard's arguments ---------------------------------------------------------


def module_list_group(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """``fully_shard([norm, output])`` between the blocks and the root (torchtitan)."""
    return train_modes(uneven_transformer(), rank, world_size, titan_shard, mode)


def root_reshard_true(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """``reshard_after_forward=True`` on every call, the root included."""
    return train_modes(uneven_transformer(), rank, world_size, shard_transformer, mode,
                       reshard_after_forward=True)


def cpu_offload(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """``CPUOffloadPolicy(pin_memory=False)`` with the torchtitan grouping."""
    result = train_modes(uneven_transformer(), rank, world_size, titan_shard, mode,
                         offload_policy=CPUOffloadPolicy(pin_memory=False))
    model = titan_shard(uneven_transformer(), fsdp_traceable.fully_shard,
                        offload_policy=CPUOffloadPolicy(pin_memory=False))
    result["offload_flags"] = sorted({m._fsdp_group.params.offload_to_cpu for m in model.modules()
                                      if isinstance(m, fsdp_traceable.FSDPModule)})
    return result


def _ignored_norm_shard(model: Transformer, fully_shard_fn: Callable, **kwargs: Any) -> Transformer:
    ignored = {model.layers[0].attention_norm.weight, model.norm.weight}
    for layer in model.layers:
        fully_shard_fn(layer, ignored_params=ignored, **kwargs)
    fully_shard_fn(model, ignored_params=ignored, **kwargs)
    return model


def ignored_params(rank: int, world_size: int, mode: str,
                   config: TransformerConfig = UNEVEN) -> dict[str, Any]:
    """Two norm weights ignored: left unsharded, their gradients not reduced."""
    result = train_modes(uneven_transformer(config=config), rank, world_size,
                         _ignored_norm_shard, mode)
    model = _ignored_norm_shard(uneven_transformer(config=config), fsdp_traceable.fully_shard)
    result["ignored_types"] = [type(model.layers[0].attention_norm.weight).__name__,
                               type(model.norm.weight).__name__]
    return result


def float64_params(rank: int, world_size: int, mode: str,
                   config: TransformerConfig = UNEVEN) -> dict[str, Any]:
    """A float64 model (gloo all-gathers and reduce-scatters float64)."""
    return train_modes(uneven_transformer(config=config).double(), rank, world_size,
                       shard_transformer, mode)


class _ChunkedHead(nn.Module):
    """A chunked-loss model: ``forward`` stops before the head, which the loss calls per
    chunk of the sequence."""

    def __init__(self, config: TransformerConfig = UNEVEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.body = nn.Sequential(nn.Linear(config.dim, config.dim), nn.GELU())
        self.norm = nn.RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(self.embed(tokens)))


def _chunked_step(model: _ChunkedHead, tokens: torch.Tensor, targets: torch.Tensor,
                  chunks: int = 3) -> float:
    """The chunked-loss pattern: the body's output detached and split by position, the
    head and loss run and backpropagated per chunk, then the body's backward with the
    chunks' input gradients."""
    h = model(tokens)
    total, grads = 0.0, []
    for h_chunk, target in zip(h.detach().chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        h_chunk = h_chunk.contiguous().requires_grad_(True)
        loss = F.cross_entropy(model.head(h_chunk).flatten(0, 1), target.flatten())
        loss.backward()
        total += loss.item()
        grads.append(h_chunk.grad)
    h.backward(torch.cat(grads, dim=1))
    return total


def chunked_head_after_group_forward(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """``fully_shard([norm, head])`` whose ``head`` the model's forward skips and the loss
    then calls on its own, per chunk (eager)."""
    assert mode == "eager", mode
    torch.manual_seed(0)
    base = _ChunkedHead()
    result = {}
    for name, fully_shard_fn in LIBRARIES:
        model = copy.deepcopy(base)
        fully_shard_fn(model.embed)
        fully_shard_fn(model.body)
        fully_shard_fn([model.norm, model.head])
        fully_shard_fn(model)
        optimizer = make_optimizer("adamw", model.parameters())
        losses, grads = [], None
        for step in range(2):
            losses.append(_chunked_step(model, *batch(step, rank, world_size, UNEVEN)))
            if grads is None:
                grads = [_local(p.grad).clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
        result[name] = {"losses": losses, "grads": grads, "params": full_params(model),
                        "locals": [_local(p).detach().clone() for p in model.parameters()]}
    return result


def _cast_after_sharding(model: Transformer, fully_shard_fn: Callable, **kwargs: Any) -> Transformer:
    return shard_transformer(model, fully_shard_fn, **kwargs).to(torch.float64)


def float64_after_fully_shard(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """``model.to(torch.float64)`` after ``fully_shard``: the next all-gathers, compute,
    gradients and optimizer state in float64."""
    return train_modes(uneven_transformer(), rank, world_size, _cast_after_sharding, mode)


def shard_placement_result(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """``shard_placement_fn`` returning ``ShardPlacementResult`` on fully_shard's mesh:
    ``Shard(1)`` for matrices whose dim 1 divides evenly, the default otherwise."""
    # (torch 2.12+: imported here, so the other cases run on older torch)
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    mesh_info = FSDPMeshInfo(mesh, shard_mesh_dim=0)

    def placement(param: nn.Parameter) -> ShardPlacementResult:
        even = param.ndim == 2 and param.shape[1] % world_size == 0
        return ShardPlacementResult(placement=Shard(1) if even else None, mesh_info=mesh_info)

    result = train_modes(uneven_transformer(), rank, world_size, shard_transformer, mode,
                         mesh=mesh, shard_placement_fn=placement)
    model = shard_transformer(uneven_transformer(), fsdp_traceable.fully_shard, mesh=mesh,
                              shard_placement_fn=placement)
    result["placements"] = sorted({str(p.placements) for p in model.parameters()})
    return result


# -- meta-device init ------------------------------------------------------------------


def init_weights(model: nn.Module) -> None:
    """A torchtitan-style ``init_weights``: truncated normal matrices, ones for norms."""
    for name, param in model.named_parameters():
        if "norm" in name:
            nn.init.ones_(param)
        else:
            nn.init.trunc_normal_(param, mean=0.0, std=0.02)


def meta_init(rank: int, world_size: int, how: str, mode: str = "eager",
              config: TransformerConfig = UNEVEN) -> dict[str, Any]:
    """Built on meta, sharded (torchtitan grouping), ``to_empty``, then initialized by
    ``reset_parameters()`` of every module or by :func:`init_weights`, from one seed;
    FSDP2 trains eagerly, ours in ``mode``."""
    result = {}
    for name, fully_shard_fn in LIBRARIES:
        with torch.device("meta"):
            model = Transformer(config)
        titan_shard(model, fully_shard_fn)
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        if how == "reset_parameters":
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        else:
            init_weights(model)
        initial = [_local(p).detach().clone() for p in model.parameters()]
        result[name] = run_steps(model, rank, world_size, mode if name == "ours" else "eager", 3)
        result[name]["initial"] = initial
        result[name]["devices"] = sorted({p.device.type for p in model.parameters()})
    return result


# -- torch's FSDPModule surface -----------------------------------------------------------


class Scoring(Transformer):
    """A transformer with a method other than forward that reads the root's parameters."""

    def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings.weight[: tokens.size(1)]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))[:, -1]

    def logits_via_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self(tokens)[:, -1] * self.output.weight.sum()


def forward_methods(rank: int, world_size: int) -> dict[str, Any]:
    """``register_fsdp_forward_method`` on ``last_logits`` (reads root parameters directly)
    and on ``logits_via_forward`` (calls forward inside), with backward and a step."""
    torch.manual_seed(0)
    base = Scoring(UNEVEN)
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        model = shard_transformer(copy.deepcopy(base), fully_shard_fn)
        register_fsdp_forward_method(model, "last_logits")
        register_fsdp_forward_method(model, "logits_via_forward")
        optimizer = make_optimizer("adamw", model.parameters())
        outputs = []
        for step in range(4):
            tokens, _ = batch(step, rank, world_size, UNEVEN)
            # One method per backward: with several forwards before one backward, we
            # reduce-scatter per forward where FSDP2 sums first (last bits differ).
            method = model.last_logits if step % 2 == 0 else model.logits_via_forward
            out = method(tokens)
            out.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            outputs.append(out.detach())
        result[name] = {"outputs": outputs, "params": full_params(model),
                        "is_torch_fsdp_module": isinstance(model, TorchFSDPModule)}
    return result


# -- unshard life cycle -----------------------------------------------------------------


def unshard_life_cycle(rank: int, world_size: int, async_op: bool, mode: str = "eager",
                       config: TransformerConfig = UNEVEN) -> dict[str, Any]:
    """``unshard()`` (all groups), forward, backward, step, then plain forwards: the
    forward after the step must see the new weights. Also a bare unshard/reshard.
    FSDP2 runs eagerly; ours in ``mode`` (``compile-ca``: the model under
    ``torch.compile(fullgraph=True)``, backward under compiled autograd)."""
    base = uneven_transformer(config=config)
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        model = shard_transformer(copy.deepcopy(base), fully_shard_fn)
        ours_mode = mode if name == "ours" else "eager"
        forward = model if ours_mode == "eager" else torch.compile(
            model, backend=compile_backend(ours_mode), fullgraph=True)
        backward_ctx = backward_context(ours_mode)
        optimizer = make_optimizer("adamw", model.parameters())
        sums, outputs = [], []
        for step in range(3):
            if step < 2:
                handles = [m.unshard(async_op=async_op) for m in model.modules()
                           if isinstance(m, TorchFSDPModule)]
                if async_op and step == 0:
                    for handle in handles:
                        handle.wait()
            tokens, targets = batch(step, rank, world_size, UNEVEN)
            logits = forward(tokens)
            sums.append(logits.detach().sum().item())
            outputs.append(logits.detach().clone())
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            with backward_ctx():
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.unshard()
        model.reshard()
        with torch.no_grad():
            outputs.append(forward(batch(9, rank, world_size, UNEVEN)[0]))
        sums.append(outputs[-1].sum().item())
        result[name] = {"sums": sums, "outputs": outputs, "params": full_params(model)}
        if ours_mode == "eager":
            # The root does not reshard after forward, a no-grad one included: FSDP2's
            # unshard() and the next forward then gather the blocks only.
            with record_all_gathers(lambda output, input, group: input.numel()) as gathers:
                handles = [m.unshard(async_op=async_op) for m in model.modules()
                           if isinstance(m, TorchFSDPModule)]
                for handle in handles:
                    if handle is not None:
                        handle.wait()
                forward(batch(10, rank, world_size, UNEVEN)[0])
            result[name]["gathers_after_no_grad"] = gathers
    return result


# -- Hugging Face Llama ---------------------------------------------------------------------


def tiny_llama_config() -> Any:
    """A tiny ``LlamaConfig`` with uneven shards at 2 and 3 ranks (71 rows, 51 hidden)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=71, hidden_size=32, intermediate_size=51,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=32, tie_word_embeddings=False,
                       attn_implementation="eager")


def llama_from_meta(fully_shard_fn: Callable, reference_buffers: list[torch.Tensor]) -> nn.Module:
    """The tiny ``LlamaForCausalLM`` built on meta, sharded per decoder layer and at the
    root, ``to_empty``, its buffers copied from ``reference_buffers``, initialized by
    :func:`init_weights` from one seed."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config())
    for layer in model.model.layers:
        fully_shard_fn(layer)
    fully_shard_fn(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for buffer, reference in zip(model.buffers(), reference_buffers, strict=True):
            buffer.copy_(reference)
    torch.manual_seed(11)
    init_weights(model)
    return model


def llama_buffers() -> list[torch.Tensor]:
    """Non-persistent buffers (the rotary frequencies) are computed in ``__init__``,
    which meta skips; they come from a model built on CPU, as an init_weights would."""
    from transformers import LlamaForCausalLM

    return [b.clone() for b in LlamaForCausalLM(tiny_llama_config()).buffers()]


def llama_meta_init(rank: int, world_size: int) -> dict[str, Any]:
    """A tiny ``LlamaForCausalLM`` (no weights) built on meta, sharded per decoder layer
    and at the root, ``to_empty``, initialized from one seed, 3 AdamW steps."""
    reference_buffers = llama_buffers()
    result = {}
    for name, fully_shard_fn in LIBRARIES:
        model = llama_from_meta(fully_shard_fn, reference_buffers)
        optimizer = make_optimizer("adamw", model.parameters())
        losses = []
        for step in range(3):
            tokens, targets = batch(step, rank, world_size, UNEVEN)
            loss = model(input_ids=tokens, labels=targets).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        result[name] = {"losses": losses, "params": full_params(model)}
    return result


# -- reshard_after_forward=N -----------------------------------------------------------


def all_gather_group_sizes() -> contextlib.AbstractContextManager[list[int]]:
    """Records the process-group size of every eager c10d all-gather either library issues."""
    return record_all_gathers(lambda output, input, group: dist.get_world_size(group))


def reshard_to_subgroups(rank: int, world_size: int, group_size: int) -> dict[str, Any]:
    """``reshard_after_forward=group_size`` on every group (torchtitan grouping): the
    training numbers, and the group size of each all-gather in one step's forward and
    backward."""
    result = train_modes(uneven_transformer(), rank, world_size, titan_shard,
                         reshard_after_forward=group_size)
    for name, fully_shard_fn in LIBRARIES:
        model = titan_shard(uneven_transformer(), fully_shard_fn, reshard_after_forward=group_size)
        with all_gather_group_sizes() as forward_sizes:
            loss = model.loss(*batch(0, rank, world_size, UNEVEN))
        with all_gather_group_sizes() as backward_sizes:
            loss.backward()
        result[name]["forward_group_sizes"] = forward_sizes
        result[name]["backward_group_sizes"] = backward_sizes
    return result


# -- a mesh of one rank -----------------------------------------------------------------


def single_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Training on a one-rank mesh (torchtitan grouping), and the eager c10d all-gathers
    of one step: FSDP2 copies the shards straight into the unsharded parameters there."""
    result = train_modes(uneven_transformer(), rank, world_size, titan_shard)
    for name, fully_shard_fn in LIBRARIES:
        model = titan_shard(uneven_transformer(), fully_shard_fn)
        with all_gather_group_sizes() as sizes:
            model.loss(*batch(0, rank, world_size, UNEVEN)).backward()
        result[name]["all_gather_group_sizes"] = sizes
    return result
