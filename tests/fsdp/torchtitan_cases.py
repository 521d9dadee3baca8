"""Rank-side body of the torchtitan test: torchtitan's own Llama 3 model and its own
``parallelize_llama`` (tensor parallel with sequence parallel, then ``fully_shard`` per
block, the embedding, ``[norm, lm_head]`` as one group and the root, bf16 parameters,
fp32 reduction, gradient division off) on a (dp_shard=2, tp=2) mesh of 4 ranks, once
with torch's ``fully_shard`` and once with ours in its place.

Three things differ from torchtitan's trainer, all on both sides alike:
- The attention is torchtitan's ``ScaledDotProductAttention`` (as its graph-trainer
  tests build it): its language-model backends are FlexAttention, which has no CPU
  backward, and varlen attention, which needs CUDA.
- ``ParallelDims`` builds its meshes on the CPU: torchtitan picks ``cuda`` on a
  machine without an accelerator.
- FSDP2 reduces with ``set_force_sum_reduction_for_comms``: torchtitan sets a gradient
  divide factor of 1, for which FSDP2 reduces with ``premul_sum``, which gloo lacks.
  Ours gets torchtitan's calls unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_traceable
from tests.fsdp.features.tensor_parallel_cases import SEQ, VOCAB, train

DIM, N_HEADS, N_KV_HEADS, N_LAYERS = 32, 4, 2, 2


def llama3_config() -> Any:
    """torchtitan's ``debugmodel`` in miniature, with SDPA attention."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=SEQ, theta=500000,
                                    scaling="llama"),
            attn_backend="flex"))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def parallelized_llama3(fully_shard: Callable[..., Any], compile_backend: str | None = None,
                        ac: str | None = None) -> tuple[Any, Any]:
    """torchtitan's trainer's set-up: the model built on meta, ``parallelize_llama`` with
    ``fully_shard`` in place of torch's (and torchtitan's own activation checkpointing of
    every block, ``ac``: ``"full"`` or ``"selective"``), then ``to_empty`` and
    ``init_weights``. Returns the model and torchtitan's ``ParallelDims``."""
    import torch.distributed as dist
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism = ParallelismConfig(data_parallel_shard_degree=2, tensor_parallel_degree=2,
                                    spmd_backend="partial_dtensor")
    config = llama3_config()
    # What Llama3Model.Config.update_from_config does outside torchtitan's trainer.
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with mock.patch.object(titan_parallel_dims, "device_type", "cpu"):
        parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        parallel_dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    with mock.patch.object(titan_fsdp, "fully_shard", fully_shard):
        model = parallelize_llama(model, parallel_dims=parallel_dims, training=TrainingConfig(),
                                  parallelism=parallelism,
                                  compile_config=CompileConfig(enable=compile_backend is not None,
                                                               components=["model"],
                                                               backend=compile_backend or "inductor"),
                                  ac_config={None: None, "full": FullAC.Config(),
                                             "selective": SelectiveAC.Config()}[ac],
                                  dump_folder="")
    if fully_shard is torch_fully_shard:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, parallel_dims


def loss_of(model: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions=positions)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss


def parity(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """torchtitan's Llama 3, parallelized by torchtitan with torch's ``fully_shard``
    (``theirs``) and with ours (``ours``), trained eagerly ``steps`` AdamW steps on the
    same data, also with torchtitan's full and selective activation checkpointing
    (``theirs_ac_full``, ``ours_ac_full``, ...); ours again with torchtitan's per-block
    compile (``blocks_compiled``) and, where the installed torch can (``whole_step``),
    with forward, loss and backward compiled as one graph (``compile_step``); both on
    AOTAutograd's eager backend, with their graph and graph-break counts."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

    result: dict[str, Any] = {}
    for name, fully_shard in (("theirs", torch_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        model, parallel_dims = parallelized_llama3(fully_shard)
        dp_rank = parallel_dims.get_mesh("fsdp").get_local_rank()
        result[name] = train(model, dp_rank, steps, loss_of=loss_of(model))
    for ac in ("full", "selective"):  # torchtitan's own activation checkpointing
        for name, fully_shard in (("theirs", torch_fully_shard), ("ours", fsdp_traceable.fully_shard)):
            model, _ = parallelized_llama3(fully_shard, ac=ac)
            result[f"{name}_ac_{ac}"] = train(model, dp_rank, steps, loss_of=loss_of(model))
    counters.clear()
    model, _ = parallelized_llama3(fsdp_traceable.fully_shard, compile_backend="aot_eager")
    result["blocks_compiled"] = train(model, dp_rank, steps, loss_of=loss_of(model))
    result["blocks_compiled"].update(graphs=counters["stats"]["unique_graphs"],
                                     graph_breaks=dict(counters["graph_break"]))
    if not dynamo_traces_backward_into_dtensors():
        return result
    model, _ = parallelized_llama3(fsdp_traceable.fully_shard)
    loss = loss_of(model)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = loss(tokens, targets)
        value.backward()
        return value.detach()

    counter = CompileCounterWithBackend("aot_eager")
    counters.clear()
    result["whole_step"] = train(model, dp_rank, steps,
                                 step_of=fsdp_traceable.compile_step(step, backend=counter))
    result["whole_step"].update(frames=counter.frame_count,
                                graph_breaks=dict(counters["graph_break"]))
    return result
