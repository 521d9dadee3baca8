"""``python -m fsdp_traceable doctor``: the patches it reports are the ones the entry
points apply, read from torch itself."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from fsdp_traceable import _torch_patches
from fsdp_traceable._torch_patches import inventory
from fsdp_traceable.cli.doctor import format_report

ROOT = Path(__file__).resolve().parents[2]

# A fresh process: nothing in place, then fully_shard, then doctor's report (as the
# command prints it), then each patch function asked whether its patch is in place.
_PROGRAM = """
import contextlib, io, json
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable._torch_patches import inventory
from fsdp_traceable.cli.main import main
from fsdp_traceable.testing import fake_process_group

start = inventory.patches_in_place()
with fake_process_group(2):  # a sharded module inside a checkpoint_wrapper too
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0] = checkpoint_wrapper(fsdp_traceable.fully_shard(model[0]))
    fsdp_traceable.fully_shard(model)
after_fully_shard = inventory.patches_in_place()
with contextlib.redirect_stdout(io.StringIO()) as out:
    assert main(["doctor", "--json"]) == 0
report = json.loads(out.getvalue())
after_doctor = inventory.patches_in_place()
answers = {name: getattr(_torch_patches, name)() for name in inventory.patch_names()
           if name != "rewrite_aot_backwards"}  # takes the rewrite; exists or not
answers["rewrite_aot_backwards"] = _torch_patches.extract_bw_module_exists()
print(json.dumps([start, after_fully_shard, report, after_doctor, answers,
                  inventory.patches_in_place()]))
"""


def test_doctor_reports_what_the_entry_points_apply() -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_PROGRAM)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    start, after_fully_shard, report, after_doctor, answers, in_place = json.loads(
        result.stdout.strip().splitlines()[-1])
    assert start == []  # importing the package applies none
    assert after_fully_shard  # fully_shard applies some on every supported torch
    patches = report["torch_patches"]
    assert patches["in_place_at_start"] == after_fully_shard
    assert patches["applied_here"]["fully_shard"] == after_fully_shard
    assert sorted(after_doctor) == sorted(n for names in patches["applied_here"].values()
                                          for n in names)
    # The marks the inventory reads agree with each patch function's own answer (asked
    # last: a patch no entry point applies on this torch is applied by asking).
    assert sorted(in_place) == sorted(name for name, on in answers.items() if on)
    assert report["versions"]["torch"] == torch.__version__
    assert report["recipes"]["eager"] is True


def test_inventory_names_every_patch_the_package_lists() -> None:
    listed = {name for name in _torch_patches.__all__
              if f":func:`{name}`" in (_torch_patches.__doc__ or "")}
    context_managers = {"isa_load_checks_answered", "header_precompile_skipped"}
    assert set(inventory.patch_names()) == listed - context_managers


def test_doctor_text_says_none_are_in_place_in_a_fresh_process() -> None:
    report = {"versions": {"python": "3", "torch": "2", "triton": None},
              "capabilities": {"cuda": False}, "recipes": {"eager": True},
              "torch_patches": {"in_place_at_start": [],
                                "applied_here": {"fully_shard": ["trust_fresh_outputs"]}}}
    text = format_report(report)
    assert "triton not installed" in text
    assert "when doctor started: none (importing fsdp_traceable applies none)" in text
    assert "  fully_shard: trust_fresh_outputs" in text
