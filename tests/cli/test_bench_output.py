"""Benchmarks write to the ignored ``benchmarks/out/`` unless published, and record the
commit they measured."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from fsdp_traceable.cli.bench_output import (
    OUT_DIR,
    PUBLISH_DIR,
    add_output_arguments,
    output_path,
    provenance,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _parse(argv: list[str]) -> Path:
    parser = argparse.ArgumentParser()
    add_output_arguments(parser, "x.json")
    args = parser.parse_args(argv)
    return output_path(args.out, args.publish, "x.json", ROOT)


def test_default_is_the_ignored_folder_and_publish_the_tracked_one() -> None:
    assert _parse([]) == ROOT / OUT_DIR / "x.json"
    assert _parse(["--publish"]) == ROOT / PUBLISH_DIR / "x.json"
    assert _parse(["--out", "elsewhere/y.json"]) == Path("elsewhere/y.json")


def test_out_dir_is_ignored_by_git() -> None:
    probe = ROOT / OUT_DIR / "probe.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0


def test_provenance_records_this_commit() -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    record = provenance(ROOT)
    assert record["commit"].split()[0] == head.stdout.strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])


def test_bench_command_defaults_to_the_ignored_folder(monkeypatch, tmp_path) -> None:
    from fsdp_traceable.cli import bench, main

    written = {}
    report = {"modes": {}, "overlap_limit_ms": {}}
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: dict(report))
    monkeypatch.setattr(bench, "write_outputs",
                        lambda rep, out: written.update(out=out, report=rep) or [out])
    monkeypatch.chdir(tmp_path)
    assert main.main(["bench"]) == 0
    assert Path(written["out"]) == OUT_DIR and "commit" in written["report"]["provenance"]
    assert main.main(["bench", "--publish"]) == 0
    assert Path(written["out"]) == PUBLISH_DIR


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_script_takes_its_output_from_bench_output(script: Path) -> None:
    source = script.read_text()
    if "def main" not in source:
        pytest.skip("not a benchmark entry point")
    assert "add_output_arguments(" in source and "output_path(" in source
    assert not re.search(r"add_argument\(\s*\"--out\"", source)
    assert "benchmarks/results" not in source.replace("``benchmarks/results/", "")
