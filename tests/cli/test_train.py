"""The ``train`` and ``bench`` commands end to end on 2 local gloo ranks (4 with tensor
or pipeline parallelism; tiny model)."""

from __future__ import annotations

import math
import re

import pytest

from fsdp_traceable import inductor_options
from fsdp_traceable.cli.bench import compiled_options, format_table, run_bench, write_outputs
from fsdp_traceable.cli.main import main
from fsdp_traceable.cli.train import TrainArgs, format_summary, train
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

pytestmark = pytest.mark.gloo
TINY = dict(dim=32, layers=2, heads=4, vocab_size=64, seq_len=16, batch_size=2)


def test_eager_training_matches_unsharded_reference_and_learns() -> None:
    result = train(TrainArgs(mode="eager", steps=12, lr=1e-2, **TINY))
    # Eager fp32 FSDP averages the per-rank losses' gradients exactly as the unsharded
    # model does with the mean loss; only summation order differs.
    assert abs(result["final_loss_difference"]) < 1e-5
    losses = result["losses"]
    assert len(losses) == 12 and losses[0] < math.log(64) + 0.5
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.4  # it learns
    summary = format_summary(result)
    assert "unsharded reference" in summary and "compiled" not in summary


def test_compiled_autograd_training_reports_graphs() -> None:
    # The counts and the report are the point here; Inductor's compiled autograd is
    # proven against FSDP2 in tests/fsdp/test_fully_shard.py.
    result = train(TrainArgs(mode="compile-ca", backend="aot_eager", steps=3, **TINY))
    assert abs(result["final_loss_difference"]) < 1e-5
    assert (result["forward_graphs"], result["backward_graphs"]) == (1, 1)
    assert (result["graph_breaks"], result["recompiles"]) == (0, 0)
    assert "1 forward graph(s), 1 compiled-autograd graph(s), 0 graph break(s)" in format_summary(result)


@pytest.mark.skipif(not dynamo_traces_backward_into_dtensors(),
                    reason="this torch's Dynamo cannot trace backward()")
@pytest.mark.parametrize("mode", ["whole-step", "whole-step-optim"])
def test_whole_step_training_reports_one_graph(mode: str) -> None:
    result = train(TrainArgs(mode=mode, backend="aot_eager", steps=3, **TINY))
    # whole-step-optim: AdamW's update in the graph, its bias corrections tensor math.
    assert abs(result["final_loss_difference"]) < 1e-5
    assert (result["forward_graphs"], result["graph_breaks"], result["recompiles"]) == (1, 0, 0)
    assert "1 whole-step graph(s), 0 graph break(s), 0 recompile(s)" in format_summary(result)


@pytest.mark.parametrize("flag, described", [("--tp", "tensor parallel 2"),
                                               ("--pp", "pipeline parallel 2 (GPipe)")])
def test_two_way_model_parallel_on_four_ranks_matches_unsharded_reference(
        capsys, flag: str, described: str) -> None:
    main(["train", flag, "2", "--world-size", "4", "--steps", "3", "--device", "cpu",
          *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]])
    out, err = capsys.readouterr()
    assert f"world size 4, {described}" in out
    # What the command says while it works (the ranks' own lines, the compile and first
    # step, go to the file descriptor and are not captured here).
    said = re.findall(r"^\[ *\d+\.\d s\] (.*)$", err, re.MULTILINE)
    assert said == ["train: eager on 4 ranks; loading the training code",
                    "starting 4 local ranks; each imports torch before it says more",
                    "ranks done; the unsharded reference: 3 steps in this process"]
    difference = float(out.split("(difference ")[1].split(")")[0])
    assert abs(difference) < 1e-5


def test_bench_reports_every_requested_mode(tmp_path) -> None:
    modes = ("fsdp2-eager", "eager", "compute-only", "comm-only")
    report = run_bench(TrainArgs(**TINY), steps=2, modes=modes)
    assert list(report["modes"]) == list(modes)
    assert report["modes"]["fsdp2-eager"]["ratio_to_fsdp2_eager"] == 1.0
    assert report["inductor_options"] is False
    assert all(row["median_step_ms"] > 0 and row["peak_bytes"] > 0
               for row in report["modes"].values())
    assert set(report["overlap_limit_ms"]) == {"eager"}
    assert format_table(report).count("\n") == len(modes) + 1
    paths = write_outputs(report, str(tmp_path))
    assert all(p.endswith((".json", ".md", ".png")) for p in paths)


def test_bench_compiles_our_modes_with_the_recipe_on_request() -> None:
    assert compiled_options("compile", False) is None
    assert compiled_options("compile-ca", True) == inductor_options()
    assert compiled_options("compile-blocks", True) == inductor_options()
    # The whole step keeps each re-gather where the backward issues it.
    assert compiled_options("whole-step", True) == inductor_options(raise_collectives=False)
    assert compiled_options("fsdp2-compile-blocks", True) is None  # torch's recipe, as is
    assert compiled_options("compute-only-compiled", True) is None


def test_bench_table_measures_compiled_modes_against_the_compiled_limit() -> None:
    row = {"first_step_s": 1.0, "peak_bytes": 2**20, "ratio_to_fsdp2_eager": None}
    report = {"overlap_limit_ms": {"eager": 100.0, "compiled": 50.0},
              "modes": {mode: {**row, "median_step_ms": 150.0}
                        for mode in ("eager", "compile-ca", "whole-step", "compile-blocks")}}
    versus_limit = [line.split("|")[4].strip() for line in format_table(report).splitlines()[2:]]
    assert versus_limit == ["1.50x", "3.00x", "3.00x", "3.00x"]


def test_cli_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--dim 30 must be divisible by --heads 4"):
        main(["train", "--dim", "30"])
    with pytest.raises(ValueError, match="--tp 3 must be at least 1 and divide --world-size 4"):
        main(["train", "--tp", "3", "--world-size", "4"])
    with pytest.raises(ValueError, match="--tp with --hsdp"):
        main(["train", "--tp", "2", "--world-size", "4", "--hsdp"])
    with pytest.raises(ValueError, match=r"n_heads \(4\) must divide by the tensor-parallel degree \(8\)"):
        main(["train", "--tp", "8", "--world-size", "8"])
    with pytest.raises(ValueError, match="--pp 3 must be at least 1 and divide --world-size 4"):
        main(["train", "--pp", "3", "--world-size", "4"])
    with pytest.raises(ValueError, match="--pp with --tp or --hsdp"):
        main(["train", "--pp", "2", "--tp", "2", "--world-size", "4"])
    with pytest.raises(ValueError, match="--pp runs --mode eager only"):
        main(["train", "--pp", "2", "--mode", "compile"])
    with pytest.raises(ValueError, match="--batch-size 3 must divide into --pp 2"):
        main(["train", "--pp", "2", "--batch-size", "3"])
    with pytest.raises(ValueError, match="unknown bench modes"):
        main(["bench", "--modes", "eager,warp-speed"])
