"""The models a plan can build on the meta device, and how each is parallelized.

Each :class:`ModelSource` builds its model with any number of its identical blocks
(:meth:`ModelSource.build`), so a plan can trace a shallow copy and extrapolate to the
real depth (:mod:`.extrapolate`), and applies the same recipe as training would:

- ``transformer``: the built-in model, ``train``'s recipe (tensor parallel with
  :func:`~fsdp_traceable.models.transformer.parallelize_transformer` on ``mesh["tp"]``,
  ``fully_shard`` per block then the root on ``mesh["dp"]``).
- ``llama3-8b|70b|405b``: torchtitan's Llama 3 flavour and torchtitan's own
  ``parallelize_llama`` (tensor + sequence parallel, activation checkpointing,
  ``fully_shard`` per block, embedding, ``[norm, output]`` and root) with this
  package's ``fully_shard`` in place of torch's. Attention is torchtitan's SDPA module
  (its default FlexAttention has no CPU path; both save the same per-head statistics).
- a Hugging Face ``config.json`` path or model name (offline only): the causal LM built
  from its config, ``fully_shard`` per decoder layer then the root.
- ``module:function``: any function returning an ``nn.Module``; ``fully_shard`` per
  child of its longest ``nn.ModuleList`` then the root, traced at full depth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..fsdp import fully_shard
from ..models.transformer import (
    Transformer,
    TransformerConfig,
    TransformerStage,
    parallelize_transformer,
)

__all__ = ["LLAMA3_FLAVOURS", "ModelSource", "ShardSettings", "model_source"]

LLAMA3_FLAVOURS = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3-405b": "405B"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ShardSettings:
    """How the model is parallelized: the plan's set-up flags."""

    tp: int = 1
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool = True
    ac: str = "none"  # "none", "full" or "selective"
    pp: int = 1  # pipeline stages, one per pipeline rank
    microbatches: int = 0  # per step and data-parallel rank; 0: ``pp``
    schedule: str = "1f1b"  # "1f1b" or "gpipe"
    dp_replicate: int = 1  # HSDP: replicas of the (replicate, shard) mesh
    offload: bool = False  # CPUOffloadPolicy: sharded state on the host

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=_DTYPES[self.param_dtype],
                                    reduce_dtype=_DTYPES[self.reduce_dtype])

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp

    def fsdp_kwargs(self, dp_mesh: DeviceMesh) -> dict[str, Any]:
        """``fully_shard``'s arguments for a block (the root: without
        ``reshard_after_forward``, which it keeps at its default)."""
        kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": self.mp_policy}
        if self.offload:
            kwargs["offload_policy"] = host_offload()
        return kwargs


def host_offload() -> CPUOffloadPolicy:
    """``CPUOffloadPolicy`` as a plan can apply it: pinned memory needs an accelerator,
    and pinning changes no byte a plan counts."""
    return CPUOffloadPolicy(pin_memory=False)


@dataclass
class ModelSource:
    """One model kind: how to build it at a depth, parallelize it and take its loss.

    Attributes:
        name: what the report calls the model.
        depth: the real number of identical blocks.
        vocab_size: token ids are drawn below it.
        build: ``build(depth)``: the model with ``depth`` blocks, on the meta device.
        parallelize: ``parallelize(model, world_size, settings)``: tensor parallel,
            activation checkpointing and ``fully_shard``, in the model's recipe.
        loss: ``loss(model, tokens, targets)``: the scalar loss.
        extrapolable: whether the blocks are identical (a shallow trace stands for all).
        step_context: the context forward and backward run in (torchtitan's
            ``loss_parallel`` for a vocabulary-sharded output).
        stage_blocks: ``stage_blocks(pp)``: blocks of each pipeline stage at the real
            depth, as the model's pipeline split assigns them; ``None``: no ``--pp``.
        build_stage: ``build_stage(depth, first, last)``: one pipeline stage with
            ``depth`` blocks, the embeddings if ``first``, the norm and output if
            ``last``, on the meta device.
        stage_loss: ``stage_loss(output, targets)``: the last stage's loss per microbatch.
        hidden: ``hidden(microbatch, seq_len, settings)``: what one stage sends the next
            (an example, made in the fake mode).
    """

    name: str
    depth: int
    vocab_size: int
    build: Callable[[int], nn.Module]
    parallelize: Callable[[nn.Module, int, ShardSettings], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    extrapolable: bool = True
    step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    stage_blocks: Callable[[int], list[int]] | None = None
    build_stage: Callable[[int, bool, bool], nn.Module] | None = None
    stage_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    hidden: Callable[[int, int, ShardSettings], torch.Tensor] | None = None


def model_source(model: str, *, layers: int = 4, dim: int = 128, heads: int = 4,
                 vocab_size: int = 256, seq_len: int = 64) -> ModelSource:
    """The :class:`ModelSource` named by ``--model``.

    Args:
        model: ``transformer``, ``llama3-8b|70b|405b``, a ``config.json`` path or Hugging
            Face model name, or ``module:function``.
        layers, dim, heads, vocab_size, seq_len: the built-in transformer's sizes.

    Raises:
        ValueError: ``model`` names nothing known (no such file, no offline config).
    """
    if model == "transformer":
        return _builtin(TransformerConfig(vocab_size=vocab_size, dim=dim, n_layers=layers,
                                          n_heads=heads, max_seq_len=seq_len))
    if model in LLAMA3_FLAVOURS:
        return _llama3(LLAMA3_FLAVOURS[model], seq_len)
    if ":" in model and not os.path.exists(model):
        return _user_function(model, vocab_size)
    return _hugging_face(model)


# -- shared recipe pieces ---------------------------------------------------------------


def plan_meshes(world_size: int, settings: ShardSettings) -> dict[str, DeviceMesh]:
    """The ``(pp, dp_replicate, dp, tp)`` mesh over every rank (dimensions of size 1
    left out), as ``train`` and torchtitan order it: ``"dp"`` is the mesh
    ``fully_shard`` takes (2-D ``(dp_replicate, dp)`` for HSDP), ``"pp"`` and ``"tp"``
    are there when used."""
    dp = world_size // (settings.tp * settings.pp * settings.dp_replicate)
    sizes = {"pp": settings.pp, "dp_replicate": settings.dp_replicate, "dp": dp,
             "tp": settings.tp}
    names = tuple(n for n, size in sizes.items() if size > 1 or n == "dp")
    mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    meshes = {n: mesh[n] for n in names if n != "dp_replicate"}
    if settings.dp_replicate > 1:
        meshes["dp"] = mesh["dp_replicate", "dp"]
    return meshes


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective AC: keep matmul and attention outputs, recompute the rest."""
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                  torch.ops.aten._scaled_dot_product_efficient_attention.default,
                  torch.ops.aten._scaled_dot_product_flash_attention.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed(block: nn.Module, ac: str) -> nn.Module:
    """``checkpoint_wrapper(block)`` for ``--ac full|selective`` (torchtitan's order:
    wrap, then ``fully_shard`` the wrapper)."""
    if ac == "none":
        return block
    if ac == "selective":
        return checkpoint_wrapper(block, context_fn=_selective_context)
    return checkpoint_wrapper(block)


def _shard_blocks(model: nn.Module, blocks: nn.ModuleList, world_size: int,
                  settings: ShardSettings) -> nn.Module:
    if settings.tp > 1 or settings.pp > 1:
        raise NotImplementedError(
            "--tp > 1 and --pp > 1 are supported by plan for --model transformer and "
            "llama3-* only: this model has no tensor-parallel plan or pipeline split here")
    dp_mesh = plan_meshes(world_size, settings)["dp"]
    for index, block in enumerate(blocks):
        blocks[index] = _checkpointed(block, settings.ac)
    for block in blocks:
        fully_shard(block, **settings.fsdp_kwargs(dp_mesh),
                    reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, **settings.fsdp_kwargs(dp_mesh))  # the root keeps its own
    return model


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- the models -------------------------------------------------------------------------


def _builtin(config: TransformerConfig) -> ModelSource:
    def build(depth: int) -> nn.Module:
        with torch.device("meta"):
            return Transformer(TransformerConfig(**{**config.__dict__, "n_layers": depth}))

    def parallelize(model: nn.Module, world_size: int, settings: ShardSettings) -> nn.Module:
        meshes = plan_meshes(world_size, settings)
        if "tp" in meshes:
            parallelize_transformer(model, meshes["tp"])
        for index, block in enumerate(model.layers):
            model.layers[index] = _checkpointed(block, settings.ac)
        for block in model.layers:
            fully_shard(block, **settings.fsdp_kwargs(meshes["dp"]),
                        reshard_after_forward=settings.reshard_after_forward)
        # The root keeps fully_shard's default (it does not reshard after forward).
        fully_shard(model, **settings.fsdp_kwargs(meshes["dp"]))
        return model

    def stage_blocks(pp: int) -> list[int]:
        # TransformerStage's split (train --pp): as even as it goes, earlier stages first.
        per_stage, extra = divmod(config.n_layers, pp)
        return [per_stage + (index < extra) for index in range(pp)]

    def build_stage(depth: int, first: bool, last: bool) -> nn.Module:
        model = build(depth)
        stage = TransformerStage(model, 0, 1)  # every block; then drop the ends
        stage.config = model.config  # for parallelize_transformer's checks
        stage.is_first, stage.is_last = first, last
        if not first:
            stage.tok_embeddings = stage.pos_embeddings = None
        if not last:
            stage.norm = stage.output = None
        return stage

    def hidden(microbatch: int, seq_len: int, settings: ShardSettings) -> torch.Tensor:
        return torch.empty(microbatch, seq_len, config.dim, dtype=_DTYPES[settings.param_dtype],
                           requires_grad=True)

    return ModelSource(f"transformer (dim {config.dim}, {config.n_layers} blocks)",
                       config.n_layers, config.vocab_size, build, parallelize,
                       lambda model, tokens, targets: model.loss(tokens, targets),
                       stage_blocks=stage_blocks, build_stage=build_stage,
                       stage_loss=_cross_entropy, hidden=hidden)


def _llama3(flavour: str, seq_len: int) -> ModelSource:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    base = llama3_configs[flavour](attn_backend="flex")
    meshes: dict[str, DeviceMesh] = {}  # the last parallelized model's (a stage's inputs)

    def config_at(depth: int) -> Any:
        config = llama3_configs[flavour](attn_backend="flex")
        config.layers = config.layers[:depth]
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
            # What torchtitan's trainer does (Decoder.Config.update_from_config): each
            # block's RoPE cache covers the training sequence, not the flavour's maximum.
            layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
        return config

    def build(depth: int) -> nn.Module:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        config = config_at(depth)
        set_llama3_sharding_config(config, enable_sp=True)
        with torch.device("meta"):
            return config.build()

    def parallelize(model: nn.Module, world_size: int, settings: ShardSettings) -> nn.Module:
        import torchtitan.distributed.fsdp as titan_fsdp
        import torchtitan.distributed.parallel_dims as titan_parallel_dims
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.models.llama3 import parallelize_llama

        parallelism = ParallelismConfig(
            data_parallel_shard_degree=world_size // (settings.tp * settings.pp
                                                      * settings.dp_replicate),
            data_parallel_replicate_degree=settings.dp_replicate,
            tensor_parallel_degree=settings.tp, pipeline_parallel_degree=settings.pp,
            spmd_backend="partial_dtensor",
            fsdp_reshard_after_forward="always" if settings.reshard_after_forward else "never")
        names = {"fp32": "float32", "bf16": "bfloat16"}
        if settings.reduce_dtype != "fp32":
            raise ValueError("--model llama3-*: torchtitan reduces gradients in fp32 only; "
                             "pass --reduce-dtype fp32")
        training = TrainingConfig(mixed_precision_param=names[settings.param_dtype],
                                  mixed_precision_reduce="float32",
                                  enable_cpu_offload=settings.offload)
        with mock.patch.object(titan_parallel_dims, "device_type", "cpu"):
            parallel_dims = ParallelDims.from_config(parallelism, world_size)
            parallel_dims.build_mesh()
        if settings.tp > 1:
            meshes["tp"] = parallel_dims.get_mesh("tp")
        ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}
        with mock.patch.object(titan_fsdp, "fully_shard", fully_shard), \
                mock.patch.object(titan_fsdp, "CPUOffloadPolicy", host_offload):
            return parallelize_llama(model, parallel_dims=parallel_dims, training=training,
                                     parallelism=parallelism,
                                     compile_config=CompileConfig(enable=False),
                                     ac_config=ac[settings.ac], dump_folder="")

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return _cross_entropy(model(tokens, positions=positions), targets)

    # torchtitan's loss parallel: with tensor parallel the output is sharded on the
    # vocabulary, and the loss (forward and backward) runs on the shards.
    from torch.distributed.tensor.parallel import loss_parallel

    def stage_blocks(pp: int) -> list[int]:
        from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

        # torchtitan's split (pipeline_llm's default: the embedding and the norm and
        # output each weigh as one block).
        names = _generate_llm_fqn_per_model_part(pp, len(base.layers))
        return [sum(n.startswith("layers.") for n in stage) for stage in names]

    def build_stage(depth: int, first: bool, last: bool) -> nn.Module:
        from torchtitan.distributed.pipeline_parallel import _split_module

        names = [f"layers.{i}" for i in range(depth)]
        names = ["tok_embeddings"] * first + names + ["norm", "lm_head"] * last
        return _split_module(build(depth), names)

    def hidden(microbatch: int, seq_len: int, settings: ShardSettings) -> torch.Tensor:
        dtype = _DTYPES[settings.param_dtype]
        if settings.tp == 1:
            return torch.empty(microbatch, seq_len, base.dim, dtype=dtype, requires_grad=True)
        # Sequence parallel: between blocks (and stages) the sequence is sharded on tp.
        from torch.distributed.tensor import DTensor, Shard

        local = torch.empty(microbatch, seq_len // settings.tp, base.dim, dtype=dtype,
                            requires_grad=True)
        return DTensor.from_local(local, meshes["tp"], [Shard(1)], run_check=False)

    return ModelSource(f"Llama 3 {flavour} (torchtitan)", len(base.layers), base.vocab_size,
                       build, parallelize, loss, step_context=loss_parallel,
                       stage_blocks=stage_blocks, build_stage=build_stage,
                       stage_loss=_cross_entropy, hidden=hidden)


def _hugging_face(name: str) -> ModelSource:
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(name):
        with open(name) as f:
            raw = json.load(f)
        config = AutoConfig.for_model(**raw)
    else:
        try:
            config = AutoConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"--model {name!r} is not a file, a built-in model (transformer, "
                f"{', '.join(LLAMA3_FLAVOURS)}), a module:function, nor a Hugging Face "
                f"config available offline ({err}); pass the path of its config.json") from None
    depth = config.num_hidden_layers

    def build(layers: int) -> nn.Module:
        shallow = type(config).from_dict({**config.to_dict(), "num_hidden_layers": layers})
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(shallow)

    def parallelize(model: nn.Module, world_size: int, settings: ShardSettings) -> nn.Module:
        return _shard_blocks(model, _decoder_layers(model), world_size, settings)

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _cross_entropy(model(input_ids=tokens).logits, targets)

    return ModelSource(f"{getattr(config, 'model_type', 'hf')} ({name})", depth,
                       config.vocab_size, build, parallelize, loss)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The longest ``nn.ModuleList`` of ``model``: its repeated blocks."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to "
                         "fully_shard one by one")
    return max(lists, key=len)


def _user_function(spec: str, vocab_size: int) -> ModelSource:
    module_name, _, function_name = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), function_name)

    def build(depth: int) -> nn.Module:
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"--model {spec}: returned {type(model).__name__}, not an nn.Module")
        return model

    def parallelize(model: nn.Module, world_size: int, settings: ShardSettings) -> nn.Module:
        return _shard_blocks(model, _decoder_layers(model), world_size, settings)

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if hasattr(model, "loss"):
            return model.loss(tokens, targets)
        return _cross_entropy(model(tokens), targets)

    return ModelSource(spec, 0, vocab_size, build, parallelize, loss, extrapolable=False)
