"""The commands' arguments, without torch: ``--help`` parses with this module alone.

Every flag has help text and shows its default (:class:`HelpFormatter`);
``tests/cli/test_arguments.py`` checks both, and that nothing here imports torch.
:mod:`.train`, :mod:`.bench` and :mod:`.explain` import torch and run the commands.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..models.transformer import TransformerConfig

TRAIN_MODES = ("eager", "compile", "compile-ca", "whole-step", "whole-step-optim")
# The modes compiled as one whole step (:func:`~fsdp_traceable.compile_step`);
# "-optim": with the optimizer's update in the graph.
WHOLE_STEP_MODES = ("whole-step", "whole-step-optim")
BACKENDS = ("inductor", "aot_eager", "eager")
BENCH_MODES = (
    "fsdp2-eager", "fsdp2-compile-blocks", "eager", "compile", "compile-ca", "whole-step",
    "whole-step-optim", "compile-blocks", "compile-blocks-ca", "compute-only",
    "compute-only-compiled", "comm-only",
)
# ``explain``'s model: ``fsdp_traceable.introspection.explain.DEMO_CONFIG``'s blocks and width
# (a test keeps them equal; importing it here would import torch).
EXPLAIN_LAYERS = 2
EXPLAIN_DIM = 64
EXPLAIN_HEADS = 4


@dataclass(frozen=True)
class TrainArgs:
    """One ``train`` (or ``bench``) run's settings; the flags' defaults."""

    mode: str = "eager"
    backend: str = "inductor"
    steps: int = 20
    mp: str | None = None
    hsdp: bool = False
    tp: int = 1
    pp: int = 1
    world_size: int = 2
    dim: int = 128
    layers: int = 4
    heads: int = 4
    vocab_size: int = 256
    seq_len: int = 64
    batch_size: int = 8
    lr: float = 3e-3
    seed: int = 0
    device: str = "auto"
    optimizer: str = "adamw"

    @property
    def config(self) -> TransformerConfig:
        from ..models.transformer import TransformerConfig

        return TransformerConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.layers,
                                 n_heads=self.heads, max_seq_len=self.seq_len)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help where there is a default to show: not
    for ``None`` or an off switch, nor where the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or "default" in help_text):
            return help_text
        return super()._get_help_string(action)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, data, optimizer and ranks: shared by ``train`` and ``bench``."""
    defaults = TrainArgs()
    parser.add_argument("--mp", choices=["bf16"], default=None,
                        help="bf16 mixed precision: bf16 parameters and compute, fp32 "
                             "gradient reduction (default: fp32 throughout)")
    parser.add_argument("--world-size", type=int, default=defaults.world_size,
                        help="local ranks to spawn when not under torchrun")
    sizes = {
        "dim": "model width (a multiple of --heads)",
        "layers": "transformer blocks",
        "heads": "attention heads",
        "vocab_size": "vocabulary size of the synthetic tokens",
        "seq_len": "tokens per sequence",
        "batch_size": "sequences per rank and step",
        "seed": "seed of the model's initialization and of the synthetic data",
    }
    for name, help_text in sizes.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            default=getattr(defaults, name), help=help_text)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="learning rate")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer,
                        help="the optimizer")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=defaults.device,
                        help="auto: cuda under torchrun on a GPU machine, else cpu; cuda "
                             "without torchrun spawns one NCCL rank per GPU")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``train`` subcommand's options to ``parser``."""
    defaults = TrainArgs()
    parser.add_argument("--mode", choices=TRAIN_MODES, default=defaults.mode,
                        help="eager (c10d), compile (whole-model torch.compile), compile-ca "
                             "(+ compiled autograd), whole-step (forward, loss and backward "
                             "as one graph: fsdp_traceable.compile_step), whole-step-optim "
                             "(and the optimizer's step in it)")
    parser.add_argument("--backend", choices=BACKENDS, default=defaults.backend,
                        help="torch.compile backend of the compiled modes: inductor, or "
                             "aot_eager / eager to debug the traced graphs without codegen")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument("--hsdp", action="store_true",
                        help="2-D mesh (replicate, shard) instead of one shard dimension")
    parser.add_argument("--tp", type=int, default=defaults.tp,
                        help="tensor-parallel degree: a (dp, tp) mesh, each block's attention "
                             "and feed-forward split over tp ranks, fully_shard on dp")
    parser.add_argument("--pp", type=int, default=defaults.pp,
                        help="pipeline-parallel degree: a (pp, dp) mesh, the blocks cut into "
                             "pp stages (GPipe, pp microbatches), each fully_shard-ed on dp")
    _add_workload_arguments(parser)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``bench`` subcommand's options to ``parser``, but ``--out`` and
    ``--publish`` (:func:`~fsdp_traceable.cli.bench_output.add_output_arguments`)."""
    parser.add_argument("--modes", default=None,
                        help="comma-separated modes to run, of: " + ", ".join(BENCH_MODES)
                             + " (default: every mode this torch runs; the whole-step ones "
                               "need torch 2.11+)")
    parser.add_argument("--bench-steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--inductor-options", action="store_true",
                        help="compile our modes with fsdp_traceable.inductor_options() (the "
                             "whole step with raise_collectives=False), the README's recipe; "
                             "without it, Inductor's defaults")
    _add_workload_arguments(parser)


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``explain`` subcommand's options to ``parser``."""
    parser.add_argument("--out", default=None,
                        help="directory for the graph and code dumps (default: none written)")
    parser.add_argument("--world-size", type=int, default=2, help="fake ranks")
    parser.add_argument("--layers", type=int, default=EXPLAIN_LAYERS, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=EXPLAIN_DIM,
                        help=f"model width, a multiple of {EXPLAIN_HEADS}")
    parser.add_argument("--steps", type=int, default=2, help="train steps")
    parser.add_argument("--no-compiled-autograd", action="store_true",
                        help="use AOTAutograd's backward instead of compiled autograd")
    parser.add_argument("--inductor-options", action="store_true",
                        help="compile with fsdp_traceable.inductor_options() (overlap passes, "
                             "one reduce-scatter copy-in kernel per group; with --whole-step, "
                             "raise_collectives=False)")
    parser.add_argument("--whole-step", action="store_true",
                        help="forward, loss and backward as one graph (fsdp_traceable."
                             "compile_step, torch 2.11+) instead of compiled autograd")
    parser.add_argument("--aot-eager", action="store_true",
                        help="stop after AOTAutograd (faster; no generated code)")


@dataclass(frozen=True)
class PlanArgs:
    """One ``plan`` run's settings; the flags' defaults."""

    model: str = "transformer"
    world_size: int = 8
    tp: int = 1
    pp: int = 1
    microbatches: int = 0
    schedule: str = "1f1b"
    dp_replicate: int = 1
    offload: bool = False
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    reshard_after_forward: str = "true"
    ac: str = "none"
    batch_size: int = 1
    seq_len: int = 2048
    optimizer: str = "adamw"
    dim: int = 128
    layers: int = 4
    heads: int = 4
    vocab_size: int = 256
    full_trace: bool = False
    json: bool = False
    gpu: str | None = None
    plot: str | None = None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``plan`` subcommand's options to ``parser``."""
    defaults = PlanArgs()
    parser.add_argument("--model", default=defaults.model,
                        help="transformer (the built-in model, sized by --dim/--layers/--heads/"
                             "--vocab-size), llama3-8b|llama3-70b|llama3-405b (torchtitan), "
                             "a Hugging Face config.json path or model name known offline, "
                             "or module:function returning an nn.Module")
    parser.add_argument("--world-size", type=int, default=defaults.world_size,
                        help="ranks in all (data parallel x --tp x --pp x --dp-replicate); "
                             "none are started")
    parser.add_argument("--tp", type=int, default=defaults.tp,
                        help="tensor-parallel degree: a (dp, tp) mesh as train and torchtitan "
                             "build it, fully_shard on dp")
    parser.add_argument("--pp", type=int, default=defaults.pp,
                        help="pipeline stages (the model's own split; the report is per "
                             "stage, the one with the highest peak in full)")
    parser.add_argument("--microbatches", type=int, default=defaults.microbatches,
                        help="with --pp: microbatches per step (default: --pp); "
                             "--batch-size must divide into them")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default=defaults.schedule,
                        help="with --pp: torch.distributed.pipelining's Schedule1F1B or "
                             "ScheduleGPipe")
    parser.add_argument("--dp-replicate", type=int, default=defaults.dp_replicate,
                        help="HSDP: replicas of a (replicate, shard) mesh; gradients are "
                             "all-reduced across them")
    parser.add_argument("--offload", action="store_true",
                        help="CPUOffloadPolicy: sharded parameters, gradients and optimizer "
                             "state on the host")
    parser.add_argument("--param-dtype", choices=["fp32", "bf16"], default=defaults.param_dtype,
                        help="MixedPrecisionPolicy.param_dtype: the unsharded parameters' and "
                             "compute's dtype (sharded parameters stay fp32)")
    parser.add_argument("--reduce-dtype", choices=["fp32", "bf16"],
                        default=defaults.reduce_dtype,
                        help="MixedPrecisionPolicy.reduce_dtype of the gradient reduction")
    parser.add_argument("--reshard-after-forward", choices=["true", "false"],
                        default=defaults.reshard_after_forward,
                        help="fully_shard(reshard_after_forward=...) of every block")
    parser.add_argument("--ac", choices=["none", "full", "selective"], default=defaults.ac,
                        help="activation checkpointing of every block (selective: keep matmul "
                             "and attention outputs)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="sequences per data-parallel rank and step")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer,
                        help="the optimizer (foreach updates, as on a GPU)")
    for name, help_text in {"dim": "built-in transformer: width", "layers": "built-in "
                            "transformer: blocks", "heads": "built-in transformer: heads",
                            "vocab_size": "built-in transformer or module:function: "
                            "vocabulary size"}.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            default=getattr(defaults, name), help=help_text)
    parser.add_argument("--full-trace", action="store_true",
                        help="trace every block instead of 2 and 3 blocks extrapolated to the "
                             "model's depth")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--gpu", choices=["h100", "h200", "b200"], default=None,
                        help="estimate the step time on this GPU (datasheet peaks)")
    parser.add_argument("--plot", default=None,
                        help="write the memory over the traced step to this PNG (matplotlib)")
