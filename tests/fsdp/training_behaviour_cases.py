"""Rank-side bodies of the training-behaviour tests: each drives torch's FSDP2 and ours
through the same small model and calls, and returns what the parent test compares.

The behaviours are those FSDP2's own test files check on accelerators (gradient-norm
clipping of DTensor gradients, mixed-precision dtype combinations, forward-input casts,
structured activations between sharded modules, unused outputs and modules, frozen
parameters inside a group, ``torch.func.jvp`` through sharded modules); here they run
on gloo ranks against FSDP2 itself, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_traceable
from tests.fsdp.feature_cases import record_c10d_calls, seeded_transformer
from tests.fsdp.parity_utils import batch, full_params, make_optimizer, shard_copies

LIBRARIES = (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard))
DIM = 12
NORM_TYPES = (2.0, 1.0, math.inf)


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _inputs(rank: int, step: int, rows: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, DIM, generator=generator).to(dtype)


def _train_small(model: nn.Module, rank: int, steps: int = 2,
                 loss_of: Callable[[Any, int], torch.Tensor] | None = None) -> dict[str, Any]:
    """AdamW steps of ``loss_of(model(x), step)`` (default: the output's sum).

    Returns:
        ``losses``, ``grads`` (full, before the first step; ``None`` where none) and
        ``params`` (full, at the end).
    """
    loss_of = loss_of or (lambda out, step: out.sum())
    optimizer = make_optimizer("adamw", model.parameters())
    losses, grads = [], None
    for step in range(steps):
        loss = loss_of(model(_inputs(rank, step)), step)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = [_full(p.grad) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
    return {"losses": losses, "grads": grads, "params": full_params(model)}


def _both(build: Callable[[Callable], nn.Module], rank: int, **train_kwargs: Any) -> dict[str, Any]:
    """``build(fully_shard_fn)`` with each library (same seed), each trained the same way."""
    result = {}
    for name, fully_shard_fn in LIBRARIES:
        torch.manual_seed(0)
        result[name] = _train_small(build(fully_shard_fn), rank, **train_kwargs)
    return result


# -- gradient-norm clipping ------------------------------------------------------------


def clip_grad_norm(rank: int, world_size: int) -> dict[str, Any]:
    """``torch.nn.utils.clip_grad_norm_`` (foreach) on the sharded DTensor gradients, for
    the 2-, 1- and inf-norms: total norm, clipped gradients, parameters after a step,
    and the DTensor all-reduces the norm needs (one per mesh dim)."""
    result: dict[str, Any] = {}
    for norm_type in NORM_TYPES:
        for name, model in zip(("theirs", "ours"), shard_copies(seeded_transformer())):
            optimizer = make_optimizer("adamw", model.parameters())
            model.loss(*batch(0, rank, world_size)).backward()
            with CommDebugMode() as comm_mode:
                total = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), max_norm=0.05, norm_type=norm_type, foreach=True)
            counts = comm_mode.get_comm_counts()
            result[f"{name}_{norm_type}"] = {
                "total_norm": _full(total),
                "placements": [type(p).__name__ for p in total.placements],
                "all_reduces": sum(n for op, n in counts.items() if "all_reduce" in str(op)),
                "clipped": [_full(p.grad) for p in model.parameters()],
            }
            optimizer.step()
            result[f"{name}_{norm_type}"]["params"] = full_params(model)
    return result


# -- mixed precision ---------------------------------------------------------------------


def _record_reduce_scatters(record: Callable[[torch.Tensor, torch.Tensor], Any]
                            ) -> contextlib.AbstractContextManager[list]:
    """Appends ``record(output, input)`` for every eager c10d reduce-scatter either library
    issues (the outermost call only, under each name torch has)."""
    return record_c10d_calls(("reduce_scatter_tensor", "reduce_scatter_single"),
                             lambda output, input, args, kwargs: record(output, input))


MP_COMBOS = {
    "bf16_compute": (torch.bfloat16, None),
    "bf16_compute_fp32_reduce": (torch.bfloat16, torch.float32),
    "fp32_compute_bf16_reduce": (None, torch.bfloat16),
    "fp16_compute": (torch.float16, None),
}


def mixed_precision_dtypes(rank: int, world_size: int) -> dict[str, Any]:
    """Each ``(param_dtype, reduce_dtype)`` of :data:`MP_COMBOS` on every group: losses,
    gradients and parameters, and the dtypes the reduce-scatters carried."""
    result: dict[str, Any] = {}
    for combo, (param_dtype, reduce_dtype) in MP_COMBOS.items():
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for name, model in zip(("theirs", "ours"),
                               shard_copies(seeded_transformer(), mp_policy=policy)):
            optimizer = make_optimizer("adamw", model.parameters())
            losses = []
            with _record_reduce_scatters(lambda out, inp: inp.dtype) as dtypes:
                for step in range(2):
                    loss = model.loss(*batch(step, rank, world_size))
                    loss.backward()
                    losses.append(loss.item())
                    if step == 0:
                        grads = [_full(p.grad) for p in model.parameters()]
                    optimizer.step()
                    optimizer.zero_grad()
            result[f"{name}_{combo}"] = {
                "losses": losses, "grads": grads, "params": full_params(model),
                "reduce_dtypes": sorted({str(d) for d in dtypes}),
            }
    return result


class _Linear(nn.Linear):
    """A linear that, if ``cast_inside``, casts its input to its weight's dtype itself."""

    def __init__(self, cast_inside: bool) -> None:
        super().__init__(DIM, DIM)
        self.cast_inside = cast_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype) if self.cast_inside else x)


class _Pair(nn.Module):
    """Two linears called in turn; every module records the dtype its forward received."""

    def __init__(self, seen: dict[str, torch.dtype], cast_inside: bool) -> None:
        super().__init__()
        self.first = _Linear(cast_inside=False)
        self.second = _Linear(cast_inside)
        for module_name, module in (("root", self), ("first", self.first), ("second", self.second)):
            module.register_forward_pre_hook(
                lambda mod, args, module_name=module_name: seen.__setitem__(module_name, args[0].dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)).float()


# name -> (policy of ``first``, policy of ``second``, policy of the root, cast_inside)
CAST_SCENARIOS = {
    "low_precision_second": (None, MixedPrecisionPolicy(param_dtype=torch.float16), None, False),
    "second_casts_itself": (
        None, MixedPrecisionPolicy(param_dtype=torch.float16, cast_forward_inputs=False), None,
        True),
    "first_outputs_fp32": (
        MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32), None, None,
        False),
    "root_bf16_casts_inputs": (None, None, MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                               False),
}


def forward_input_casts(rank: int, world_size: int) -> dict[str, Any]:
    """``cast_forward_inputs`` and ``output_dtype`` per module (:data:`CAST_SCENARIOS`):
    the dtype each module's forward received, and the output, backward and step."""
    result: dict[str, Any] = {}
    for scenario, (first_mp, second_mp, root_mp, cast_inside) in CAST_SCENARIOS.items():
        for name, fully_shard_fn in LIBRARIES:
            seen: dict[str, torch.dtype] = {}
            torch.manual_seed(0)
            model = _Pair(seen, cast_inside)
            for module, policy in ((model.first, first_mp), (model.second, second_mp)):
                if policy is not None:
                    fully_shard_fn(module, mp_policy=policy)
            fully_shard_fn(model, mp_policy=root_mp or MixedPrecisionPolicy())
            trained = _train_small(model, rank, steps=2)
            trained["seen"] = {k: str(v) for k, v in seen.items()}
            result[f"{name}_{scenario}"] = trained
    return result


class _ExternalInput(nn.Module):
    """Its forward takes a second input that its caller makes, not the previous layer."""

    def __init__(self, seen: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.seen = seen

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen["x"], self.seen["y"] = x.dtype, y.dtype
        return self.lin(x) * y


class _WithExternal(nn.Module):
    def __init__(self, seen: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.inner = _ExternalInput(seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.first(x), torch.ones(x.shape[0], DIM)).float()


class _CheckpointedLinear(nn.Module):
    """A sharded linear called under ``torch.utils.checkpoint``; records the dtypes its
    forward (and the recompute) sees and returns."""

    def __init__(self, checkpoint_input_dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.checkpoint_input_dtype = checkpoint_input_dtype
        self.seen: list[str] = []
        self.lin.register_forward_pre_hook(
            lambda module, args: self.seen.append(f"in:{args[0].dtype}"))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.seen.append(f"out:{out.dtype}")
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.checkpoint_input_dtype)
        return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False).float()


def _norm_model(kind: str) -> nn.Sequential:
    if kind == "layer_norm":
        return nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
    if kind == "batch_norm_1d":
        return nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Linear(DIM, DIM))
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Unflatten(1, (1, 3, 4)), nn.Conv2d(1, 2, 2),
                         nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(12, DIM))


def mixed_precision_details(rank: int, world_size: int) -> dict[str, Any]:
    """Casts FSDP2's mixed-precision tests check one by one: a second forward input the
    caller makes (cast, or not with ``cast_forward_inputs=False``); a sharded module
    under ``torch.utils.checkpoint`` (the recompute casts its inputs, or its output with
    ``output_dtype``); norm layers sharded on their own, layer norm in bf16, batch norm
    in fp32 with its fp32 buffers (``output_dtype`` bf16 only, as CPU batch norm wants);
    a frozen model's first forward under ``no_grad``, then trained (fp32 reduction)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    result: dict[str, Any] = {}
    for name, fully_shard_fn in LIBRARIES:
        for submodule_casts in (True, False):
            seen: dict[str, torch.dtype] = {}
            torch.manual_seed(0)
            model = _WithExternal(seen)
            fully_shard_fn(model.inner, mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, cast_forward_inputs=submodule_casts))
            fully_shard_fn(model, mp_policy=bf16)
            trained = _train_small(model, rank)
            trained["seen"] = {k: str(v) for k, v in seen.items()}
            result[f"{name}_external_{submodule_casts}"] = trained
        for recompute_cast in ("input", "output"):
            torch.manual_seed(0)
            model = _CheckpointedLinear(torch.float32 if recompute_cast == "input"
                                        else torch.bfloat16)
            policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
                      if recompute_cast == "input" else
                      MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                           output_dtype=torch.float32, cast_forward_inputs=False))
            fully_shard_fn(model.lin, mp_policy=policy)
            fully_shard_fn(model, mp_policy=policy)
            trained = _train_small(model, rank, steps=1)
            trained["seen"] = model.seen
            result[f"{name}_checkpoint_{recompute_cast}"] = trained
        for kind in ("layer_norm", "batch_norm_1d", "batch_norm_2d"):
            torch.manual_seed(0)
            model = _norm_model(kind)
            for i, module in enumerate(model):
                if any(True for _ in module.parameters()):
                    norm = isinstance(module, nn.modules.batchnorm._BatchNorm)
                    fully_shard_fn(module, mp_policy=(
                        MixedPrecisionPolicy(output_dtype=torch.bfloat16) if norm else bf16))
            fully_shard_fn(model, mp_policy=bf16)
            result[f"{name}_{kind}"] = _train_small(model, rank)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        fully_shard_fn(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32))
        model.requires_grad_(False)
        with torch.no_grad():
            model(_inputs(rank, 9))
        # FSDP2's root keeps its unsharded parameters registered after forward (until
        # backward): reshard so that the optimizer below steps the sharded ones.
        model.reshard()
        model.requires_grad_(True)
        try:
            with _record_reduce_scatters(lambda out, inp: str(inp.dtype)) as dtypes:
                trained = _train_small(model, rank, steps=1)
        except RuntimeError as error:  # FSDP2 of torch 2.13 reduces in bf16 here, then fails
            if name == "ours":
                raise
            result["fsdp2_frozen_first_forward_error"] = str(error).splitlines()[0]
            continue
        trained["reduce_dtypes"] = sorted(set(dtypes))
        result[f"{name}_frozen_first_forward"] = trained
    return result


# -- structured activations, unused outputs and modules -----------------------------------


@dataclasses.dataclass
class _Halves:
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass
class _Nested:
    halves: _Halves
    extra: torch.Tensor


class _NamedHalves(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


CONTAINERS = ("list", "tuple", "dict", "namedtuple", "dataclass", "nested_dataclass")


def _pack(kind: str, a: torch.Tensor, b: torch.Tensor) -> Any:
    return {"list": lambda: [a, b], "tuple": lambda: (a, b), "dict": lambda: {"l": a, "r": b},
            "namedtuple": lambda: _NamedHalves(a, b), "dataclass": lambda: _Halves(a, b),
            "nested_dataclass": lambda: _Nested(_Halves(a, b), a * b)}[kind]()


def _unpack(kind: str, packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "dict":
        return packed["l"], packed["r"]
    if kind == "dataclass":
        return packed.left, packed.right
    if kind == "nested_dataclass":
        return packed.halves.left, packed.halves.right + packed.extra
    return packed[0], packed[1]


class _ContainerBlock(nn.Module):
    """Takes and returns two activations packed in a container of one ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, packed: Any) -> Any:
        a, b = _unpack(self.kind, packed)
        return _pack(self.kind, torch.relu(self.mix(a)), self.mix(b) * a)


class _ContainerModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(_ContainerBlock(kind) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = _pack(self.kind, x, x.tanh())
        for block in self.blocks:
            packed = block(packed)
        a, b = _unpack(self.kind, packed)
        return a + b


def structured_activations(rank: int, world_size: int) -> dict[str, Any]:
    """Containers of activations between sharded blocks (:data:`CONTAINERS`), fp32, plus
    the dataclass ones with bf16 compute (inputs cast inside the containers)."""
    result: dict[str, Any] = {}
    runs = [(kind, None) for kind in CONTAINERS]
    runs += [("dataclass", torch.bfloat16), ("nested_dataclass", torch.bfloat16)]
    for kind, param_dtype in runs:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype)

        def build(fully_shard_fn: Callable, kind: str = kind) -> nn.Module:
            model = _ContainerModel(kind)
            for block in model.blocks:
                fully_shard_fn(block, mp_policy=policy)
            return fully_shard_fn(model, mp_policy=policy)

        if "dataclass" in kind and not _fsdp2_takes_dataclass_activations():
            torch.manual_seed(0)
            result[f"{kind}_{param_dtype}"] = {"ours": _train_small(build(fsdp_traceable.fully_shard),
                                                                    rank)}
            continue
        result[f"{kind}_{param_dtype}"] = _both(build, rank)
    return result


def _fsdp2_takes_dataclass_activations() -> bool:
    """FSDP2 before torch 2.13 misses a dataclass's tensors when it registers its
    pre-backward hooks (its parameters are resharded when backward reaches them)."""
    return tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


class _TwoOutputs(nn.Module):
    def __init__(self, with_second_call: bool) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.second = nn.Linear(DIM, DIM)
        self.with_second_call = with_second_call

    def forward(self, x: torch.Tensor) -> Any:
        h = self.first(x)
        if not self.with_second_call:  # ``second`` is sharded but never called
            return h
        return h, self.second(h.relu())


def unused_outputs_and_modules(rank: int, world_size: int) -> dict[str, Any]:
    """A forward output left out of the loss after the first step, and a sharded module
    forward never calls; both with reshard_after_forward True and False."""
    result: dict[str, Any] = {}
    for reshard in (True, False):
        def build_outputs(fully_shard_fn: Callable, reshard: bool = reshard) -> nn.Module:
            model = _TwoOutputs(with_second_call=True)
            fully_shard_fn(model.first, reshard_after_forward=reshard)
            return fully_shard_fn(model, reshard_after_forward=reshard)

        def build_module(fully_shard_fn: Callable, reshard: bool = reshard) -> nn.Module:
            model = _TwoOutputs(with_second_call=False)
            fully_shard_fn(model.first, reshard_after_forward=reshard)
            fully_shard_fn(model.second, reshard_after_forward=reshard)
            return fully_shard_fn(model, reshard_after_forward=reshard)

        def first_output_only_later(out: tuple, step: int) -> torch.Tensor:
            return (out[0] * out[1]).sum() if step == 0 else out[0].sum()

        result[f"unused_output_{reshard}"] = _both(build_outputs, rank,
                                                   loss_of=first_output_only_later)
        result[f"unused_module_{reshard}"] = _both(build_module, rank)
    return result


# -- frozen parameters inside a group ----------------------------------------------------


def frozen_weights_in_group(rank: int, world_size: int) -> dict[str, Any]:
    """Only the biases train (weights frozen inside every group, before or after
    ``fully_shard``): the reduce-scatters carry only the trainable numel, and each
    group's runs in the backward, not at its end."""
    result: dict[str, Any] = {}
    for freeze_after in (False, True):
        for name, fully_shard_fn in LIBRARIES:
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Sequential(nn.Linear(DIM, 3 * DIM), nn.ReLU(),
                                                  nn.Linear(3 * DIM, DIM)) for _ in range(3)))
            model_copy = copy.deepcopy(model)
            if not freeze_after:
                _freeze_weights(model)
            for block in model:
                fully_shard_fn(block)
            fully_shard_fn(model)
            if freeze_after:
                _freeze_weights(model)
            # Blocks 2 and 1 reduce from their own backward, before block 0's starts.
            events: list[str] = []
            model[0].register_forward_hook(_mark_backward_start(events, "block0"))
            with _record_reduce_scatters(lambda out, inp: events.append(out.numel())):
                trained = _train_small(model, rank)
            trained["reduce_scatter_numels"] = sorted({e for e in events if e != "block0"})
            trained["reduced_before_block0"] = events.index("block0")
            trained["initial"] = full_params(model_copy)
            result[f"{name}_{freeze_after}"] = trained
    return result


def _mark_backward_start(events: list, mark: str) -> Callable:
    """A forward hook appending ``mark`` to ``events`` when the gradient of the module's
    output is computed, i.e. when the module's backward starts."""
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: events.append(mark))
    return hook


def _freeze_weights(model: nn.Module) -> None:
    for param_name, param in model.named_parameters():
        param.requires_grad_("bias" in param_name)


# -- forward-mode AD -------------------------------------------------------------------


def _fsdp2_gathers_outside_functorch() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return hasattr(_fsdp_common, "_disable_functorch_if_active")


def forward_mode_jvp(rank: int, world_size: int) -> dict[str, Any]:
    """``torch.func.jvp`` through a sharded module whose first forward (its first
    all-gather) runs inside the transform, bf16 with input casts, reshard_after_forward
    False and True: the parameters are constants to the transform (a zero tangent),
    and a backward after it reduces as usual."""
    result: dict[str, Any] = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # FSDP2 gathers outside the transforms from torch 2.13 (before, its all-gather
    # fails on the transform's tensor wrappers): compared where it does.
    libraries = LIBRARIES if _fsdp2_gathers_outside_functorch() else LIBRARIES[1:]
    for reshard in (False, True):
        for name, fully_shard_fn in libraries:
            torch.manual_seed(0)
            encoder, decoder = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM)
            for module in (encoder, decoder):
                fully_shard_fn(module, mp_policy=policy, reshard_after_forward=reshard)
            hidden = encoder(_inputs(rank, 0, rows=1)[0])
            primal, tangent = _inputs(rank, 1, rows=2)
            output, output_tangent = torch.func.jvp(lambda unused: decoder(hidden),
                                                    (primal,), (tangent,))
            decoder(hidden).float().sum().backward()
            result[f"{name}_{reshard}"] = {
                "output": output.detach().clone(), "tangent": output_tangent.detach().clone(),
                "grads": [_full(p.grad) for m in (encoder, decoder) for p in m.parameters()],
            }
    return result


# -- a head applied chunk by chunk, kept unsharded between chunks ----------------------


VOCAB = 32


class _ChunkedHead(nn.Module):
    """torchtitan's chunked-loss layout: the forward can stop before the output head,
    which the loss then applies chunk by chunk outside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        hidden = self.norm(self.body(self.embed(tokens)))
        return hidden if skip_head else self.head(hidden)


def _fsdp2_completes_partial_groups() -> bool:
    """Whether FSDP2 finishes a list group's partial forward at the root's end (torch
    2.13+); before, FSDP2 itself crashes on the chunk loop below (torch 2.11: SIGSEGV)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return hasattr(FSDPState, "_force_complete_incomplete_states")


def chunked_head_reshard_toggle(rank: int, world_size: int) -> dict[str, Any]:
    """The head's group (``[norm, head]``) with reshard after forward and backward
    switched off for a loop of chunk forwards and backwards, switched back on and
    resharded explicitly, then the body's backward from the chunks' input gradients.
    Records whether FSDP2's ``FSDPParamGroup.is_unsharded`` (read through
    ``_get_fsdp_state()._fsdp_param_group``) holds before the first step, after each
    chunk and after ``reshard()``; the group reshards after forward from the start or not."""
    result: dict[str, Any] = {}
    libraries = LIBRARIES if _fsdp2_completes_partial_groups() else LIBRARIES[1:]
    for initial_reshard in (False, True):
        for name, fully_shard_fn in libraries:
            torch.manual_seed(0)
            model = _ChunkedHead()
            fully_shard_fn(model.embed)
            fully_shard_fn(model.body)
            fully_shard_fn([model.norm, model.head], reshard_after_forward=initial_reshard)
            fully_shard_fn(model)
            group = model.head._get_fsdp_state()._fsdp_param_group
            optimizer = make_optimizer("adamw", model.parameters())
            unsharded, losses, grads = [group.is_unsharded], [], None
            for step in range(2):
                tokens = torch.randint(0, VOCAB, (2, 8),
                                       generator=torch.Generator().manual_seed(100 * step + rank))
                hidden = model(tokens, skip_head=True)
                model.head.set_reshard_after_forward(False)
                model.head.set_reshard_after_backward(False)
                hidden_grads, loss = [], 0.0
                for chunk in torch.chunk(hidden.detach(), 2, dim=1):
                    chunk = chunk.contiguous().requires_grad_(True)
                    chunk_loss = model.head(chunk).square().mean()
                    chunk_loss.backward()
                    loss += chunk_loss.item()
                    hidden_grads.append(chunk.grad)
                    unsharded.append(group.is_unsharded)
                model.head.set_reshard_after_forward(True)
                model.head.set_reshard_after_backward(True)
                model.head.reshard()
                unsharded.append(group.is_unsharded)
                hidden.backward(torch.cat(hidden_grads, dim=1))
                losses.append(loss)
                if grads is None:
                    grads = [_full(p.grad) for p in model.parameters()]
                optimizer.step()
                optimizer.zero_grad(set_to_none=step % 2 == 0)
            result[f"{name}_{initial_reshard}"] = {
                "losses": losses, "grads": grads, "params": full_params(model),
                "unsharded": unsharded,
            }
    return result


# -- DDP and replicate with sharded modules ----------------------------------------------


def _mlp_of_three() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, DIM),
                         nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)),
                         nn.Linear(DIM, DIM))


def data_parallel_with_sharded_modules(rank: int, world_size: int) -> dict[str, Any]:
    """Data parallelism mixed with sharding, as FSDP2's tests mix them: ``DistributedDataParallel``
    around a model whose middle block alone is sharded (DDP told to leave the block's
    parameters alone, as ``test_fully_shard_ignore_params`` does); torch's ``replicate``
    on the first layer then ``fully_shard`` on the model (which leaves that layer to
    ``replicate``); ``fully_shard`` on the last layer then ``replicate`` on the model
    (which leaves that layer to FSDP)."""
    from torch.distributed._composable import replicate
    from torch.nn.parallel import DistributedDataParallel

    def ddp_around(fully_shard_fn: Callable) -> nn.Module:
        model = _mlp_of_three()
        fully_shard_fn(model[1])
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [f"1.{param_name}" for param_name, _ in model[1].named_parameters()])
        return DistributedDataParallel(model)

    def replicate_inside(fully_shard_fn: Callable) -> nn.Module:
        model = _mlp_of_three()
        replicate(model[0])
        return fully_shard_fn(model)

    def replicate_outside(fully_shard_fn: Callable) -> nn.Module:
        model = _mlp_of_three()
        fully_shard_fn(model[2])
        replicate(model)
        return model

    return {build.__name__: _both(build, rank)
            for build in (ddp_around, replicate_inside, replicate_outside)}


CASES = (
    ("clip_grad_norm", clip_grad_norm),
    ("mixed_precision_dtypes", mixed_precision_dtypes),
    ("forward_input_casts", forward_input_casts),
    ("mixed_precision_details", mixed_precision_details),
    ("structured_activations", structured_activations),
    ("unused_outputs_and_modules", unused_outputs_and_modules),
    ("frozen_weights_in_group", frozen_weights_in_group),
    ("forward_mode_jvp", forward_mode_jvp),
    ("chunked_head_reshard_toggle", chunked_head_reshard_toggle),
    ("data_parallel_with_sharded_modules", data_parallel_with_sharded_modules),
)
