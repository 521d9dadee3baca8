"""torchtitan's memory estimate of a Llama 3 step, the way its estimator made it, on a CPU.

torchtitan's ``scripts/estimate/estimation.py`` (removed from torchtitan in commit
9810191, February 2026; torchtitan 0.3.0 has no estimator) ran torch's
``FSDPMemTracker`` over two training steps of the model parallelized by torchtitan with
torch's own ``fully_shard``, under ``FakeTensorMode`` on the fake process group, and
printed the tracker's peak. It needs CUDA (``torch.cuda.set_device``,
``model.to_empty(device="cuda")``, ``torch.cuda.memory_stats``) and refuses tensor,
pipeline, context and expert parallelism ("DDP, TP, PP, CP, EP are not supported yet").
This script repeats its steps on the CPU for FSDP only: the same tracker, model,
``parallelize_llama``, two steps with gradient clipping, the peak of the second. It
differs in: device ``cpu``; torchtitan's SDPA attention (FlexAttention has no CPU path;
as ``plan`` does); AdamW with ``foreach`` (torchtitan's optimizer container defaults to
``fused``; ``plan`` uses ``foreach``); no learning-rate scheduler.

With ``--skip-sharding-propagation`` it also leaves out the ops DTensor runs at their
global shapes only to learn output shapes: under an outer ``FakeTensorMode`` (as the
estimator ran) DTensor runs them in that same mode, and the tracker counts them as
allocations (for Llama 3 8B on 8 ranks, 101 GiB of "optimizer state" instead of 7.5).

Run: ``python benchmarks/fsdp_mem_tracker_estimate.py --model llama3-8b --world-size 8
--seq-len 8192 [--skip-sharding-propagation]`` (about 30 s of CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance
from fsdp_traceable.plan.models import LLAMA3_FLAVOURS
from fsdp_traceable.plan.trace import fake_world

_SHARDING_PROPAGATION = "torch/distributed/tensor/_sharding_prop.py"


class _TrackerWithoutShardingPropagation(FSDPMemTracker):
    """``FSDPMemTracker`` that lets DTensor's shape-only ops through uncounted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.replace("\\", "/").endswith(_SHARDING_PROPAGATION):
                return func(*args, **(kwargs or {}))
            frame = frame.f_back
        return super().__torch_dispatch__(func, types, args, kwargs)


def tracker_peak(model_name: str, world_size: int, seq_len: int,
                 skip_sharding_propagation: bool) -> dict[str, int]:
    """The tracker's peak of the second step on rank 0 of ``world_size`` (FSDP only,
    bf16 parameters, fp32 reduction, full activation checkpointing, one sequence),
    bytes by the tracker's categories and ``"Total"``."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    tracker_class = (_TrackerWithoutShardingPropagation if skip_sharding_propagation
                     else FSDPMemTracker)
    with fake_world(world_size):
        parallelism = ParallelismConfig(data_parallel_shard_degree=world_size,
                                        spmd_backend="partial_dtensor",
                                        fsdp_reshard_after_forward="always")
        training = TrainingConfig(mixed_precision_param="bfloat16",
                                  mixed_precision_reduce="float32")
        with mock.patch.object(titan_parallel_dims, "device_type", "cpu"):
            parallel_dims = ParallelDims.from_config(parallelism, world_size)
            parallel_dims.build_mesh()
        config = llama3_configs[LLAMA3_FLAVOURS[model_name]](attn_backend="flex")
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
            layer.attention.rope = dataclasses.replace(layer.attention.rope,
                                                       max_seq_len=seq_len)
        set_llama3_sharding_config(config, enable_sp=False)
        with FakeTensorMode():
            with torch.device("meta"):
                model = config.build()
            parallelize_llama(model, parallel_dims=parallel_dims, training=training,
                              parallelism=parallelism, compile_config=CompileConfig(enable=False),
                              ac_config=FullAC.Config(), dump_folder="")
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1,
                                          foreach=True)
            tokens = torch.randint(0, config.vocab_size, (1, seq_len))
            positions = torch.arange(seq_len).expand_as(tokens)
            tracker = tracker_class(mod=model, optm=optimizer)
            tracker.track_inputs((tokens, tokens))
            with tracker:
                for step in range(2):
                    logits = model(tokens, positions=positions)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
                    del logits
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                    optimizer.step()
                    optimizer.zero_grad()
                    if step == 0:
                        tracker.reset_mod_stats()  # the first step has no optimizer state
                    gc.collect(1)
            (stats,) = tracker.get_tracker_snapshot("peak").values()
    return {str(getattr(k, "value", k)): int(v) for k, v in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(LLAMA3_FLAVOURS), default="llama3-8b")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--skip-sharding-propagation", action="store_true")
    add_output_arguments(parser, "fsdp_mem_tracker_estimate.json")
    options = parser.parse_args()
    stats = tracker_peak(options.model, options.world_size, options.seq_len,
                         options.skip_sharding_propagation)
    for name, nbytes in stats.items():
        print(f"{name:16s} {nbytes / 2**30:8.2f} GiB")
    path = output_path(options.out, options.publish, "fsdp_mem_tracker_estimate.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(options), "peak_bytes": stats,
                                "provenance": provenance()}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
