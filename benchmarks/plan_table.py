"""The table of docs/plan.md: torchtitan's Llama 3 8B / 70B / 405B on 8 / 64 / 512 / 1024
GPUs, memory per GPU and communication per step, from ``python -m fsdp_traceable plan``,
next to DeepSpeed's ZeRO-3 model-state formula and, where it applies (FSDP alone),
torchtitan's estimator's method (``benchmarks/fsdp_mem_tracker_estimate.py``).

ZeRO-3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", arXiv 1910.02054, section 5: "(2 + 2 + K) * Psi / N_d" with K = 12
for mixed-precision Adam): 16 bytes per parameter over the data-parallel ranks. Here
the model state is fp32 parameters (4), fp32 gradients (4) and fp32 Adam moments (8),
also 16 bytes per parameter, over dp x tp ranks.

Run: ``python benchmarks/plan_table.py`` (prints the table and writes it to
``benchmarks/out/plan_table.md``, or ``--out``/``--publish``; each row one plan,
bf16 parameters, fp32 reduction, full activation checkpointing, batch 1 x 8192 tokens
per data-parallel rank, tensor parallel 8 from 64 GPUs up, 1 below; the pipeline row:
4 stages, 1F1B over 4 microbatches of 1 x 8192 tokens, its stage with the highest peak).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fsdp_traceable.cli.arguments import PlanArgs
from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance
from fsdp_traceable.cli.plan import plan_for
from fsdp_traceable.plan.report import GIB

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_mem_tracker_estimate import tracker_peak  # noqa: E402

# (model, GPUs, tp, pp)
ROWS = [("llama3-8b", 8, 1, 1), ("llama3-8b", 64, 8, 1), ("llama3-70b", 64, 8, 1),
        ("llama3-70b", 512, 8, 1), ("llama3-70b", 512, 8, 4), ("llama3-405b", 512, 8, 1),
        ("llama3-405b", 1024, 8, 1)]
ZERO3_BYTES_PER_PARAM = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    add_output_arguments(parser, "plan_table.md")
    options = parser.parse_args()
    path = output_path(options.out, options.publish, "plan_table.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    emit("| model | GPUs (dp x tp x pp) | params + grads + Adam / GPU | ZeRO-3 formula / GPU "
         "| unsharded params at peak | activations at peak | peak / GPU "
         "| torchtitan's estimator (FSDPMemTracker) peak "
         "| FSDP all-gather / step | FSDP reduce-scatter / step | TP collectives / step "
         "| plan time |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    n_params: dict[str, int] = {}
    for model, world, tp, pp in ROWS:
        start = time.perf_counter()
        args = PlanArgs(model=model, world_size=world, tp=tp, pp=pp, seq_len=options.seq_len,
                        batch_size=pp, ac="full")
        plan = plan_for(args)
        seconds = time.perf_counter() - start
        if pp == 1:  # the fp32 sharded parameters are 4 bytes each on dp x tp ranks
            n_params[model] = plan.params_bytes // 4 * world
        zero3 = ZERO3_BYTES_PER_PARAM * n_params[model] / world
        tracker = "n/a (refuses TP, PP)"
        if tp == pp == 1:
            as_run = tracker_peak(model, world, options.seq_len, False)["Total"]
            fixed = tracker_peak(model, world, options.seq_len, True)["Total"]
            tracker = (f"{fixed / GIB:.1f} GiB ({as_run / GIB:.1f} GiB counting DTensor's "
                       "shape-only ops)")
        state = plan.params_bytes + plan.gradient_bytes + plan.optimizer_bytes
        fsdp = {"all-gather": [0, 0], "reduce-scatter": [0, 0]}
        tensor_parallel = [0, 0]
        for (kind, group, _, _), (count, nbytes) in plan.collectives.items():
            if kind in ("send", "recv"):
                continue
            target = tensor_parallel if group.startswith("tensor parallel") else fsdp[kind]
            target[0] += count
            target[1] += nbytes
        stage = "" if pp == 1 else f" (stage {plan.stage_index})"
        emit(f"| {model} | {world} ({world // tp // pp} x {tp} x {pp}) | {state / GIB:.1f} GiB"
             f"{stage} | {zero3 / GIB:.1f} GiB "
             f"| {plan.at_peak.get('unsharded parameters', 0) / GIB:.2f} GiB "
             f"| {plan.at_peak.get('activations', 0) / GIB:.2f} GiB | {plan.peak_bytes / GIB:.1f} GiB "
             f"| {tracker} "
             f"| {fsdp['all-gather'][0]} x, {fsdp['all-gather'][1] / GIB:.0f} GiB "
             f"| {fsdp['reduce-scatter'][0]} x, {fsdp['reduce-scatter'][1] / GIB:.0f} GiB "
             f"| {tensor_parallel[0]} x, {tensor_parallel[1] / GIB:.0f} GiB | {seconds:.0f} s |")
    stamp = provenance()
    path.write_text("\n".join(lines) + f"\n\n(commit {stamp['commit']}, {stamp['date']})\n")


if __name__ == "__main__":
    main()
