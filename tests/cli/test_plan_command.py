"""``python -m fsdp_traceable plan``: its JSON, the tensor-parallel set-up, and its
refusals."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from fsdp_traceable.cli.main import main

SMALL = ["plan", "--layers", "2", "--dim", "32", "--heads", "4", "--vocab-size", "64",
         "--seq-len", "16", "--batch-size", "2"]


def test_plan_json_reports_memory_and_collectives_per_group(capsys) -> None:
    assert main([*SMALL, "--world-size", "4", "--tp", "2", "--json", "--gpu", "h100"]) == 0
    report = json.loads(capsys.readouterr().out)
    memory = report["memory_per_rank_bytes"]
    assert memory["peak"] >= memory["parameters"] + memory["optimizer_state"] > 0
    groups = {(c["group"], c["kind"]) for c in report["collectives_per_step"]}
    # fully_shard on dp (2 ranks) per block and root; tensor parallel's all-reduces on tp.
    assert {("layers.*", "all-gather"), ("layers.*", "reduce-scatter"),
            ("(root)", "reduce-scatter")} <= groups
    assert any(c["kind"] == "all-reduce" and c["group"].startswith("tensor parallel")
               for c in report["collectives_per_step"])
    assert {c["ranks"] for c in report["collectives_per_step"]} == {2}
    assert report["estimate"]["step_s"] > 0


def test_plan_refuses_degrees_that_do_not_divide_and_a_pipeline_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="--tp 3"):
        main([*SMALL, "--world-size", "4", "--tp", "3"])
    with pytest.raises(ValueError, match="--dp-replicate 3 must divide --world-size 4"):
        main([*SMALL, "--world-size", "4", "--dp-replicate", "3"])
    with pytest.raises(ValueError, match="--batch-size 2 .* --microbatches 4"):
        main([*SMALL, "--world-size", "4", "--pp", "4"])
    with pytest.raises(NotImplementedError, match="no pipeline split here"):
        main([*SMALL, "--model", f"{__name__}:no_split", "--world-size", "4", "--pp", "2"])


def no_split() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.ModuleList(
        [torch.nn.Linear(16, 16)] * 2), torch.nn.Linear(16, 64))


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None,
                    reason="matplotlib is installed: the plot is drawn")
def test_plot_without_matplotlib_says_how_to_get_it(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        main([*SMALL, "--plot", str(tmp_path / "memory.png")])
