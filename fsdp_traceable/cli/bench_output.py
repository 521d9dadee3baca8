"""Where benchmark results go.

A run writes under ``benchmarks/out/`` (ignored by git) unless told otherwise, so
measuring never rewrites the published figures. ``--publish`` writes under
``benchmarks/results/`` instead: the tracked files ``docs/benchmarks.md`` cites. Every
JSON a benchmark writes records the commit it measured (:func:`provenance`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

OUT_DIR = Path("benchmarks") / "out"
PUBLISH_DIR = Path("benchmarks") / "results"

__all__ = ["OUT_DIR", "PUBLISH_DIR", "add_output_arguments", "output_path", "provenance"]


def add_output_arguments(parser: argparse.ArgumentParser, default_name: str) -> None:
    """Adds ``--out`` and ``--publish`` for an output called ``default_name``."""
    parser.add_argument(
        "--out", default=None,
        help=f"output path (default: {OUT_DIR / default_name}, or "
             f"{PUBLISH_DIR / default_name} with --publish)",
    )
    parser.add_argument(
        "--publish", action="store_true",
        help=f"write the default output under {PUBLISH_DIR}/ (tracked), not {OUT_DIR}/",
    )


def output_path(out: str | Path | None, publish: bool, default_name: str,
                root: str | Path = ".") -> Path:
    """``out`` if given, else ``default_name`` under the publish or the scratch folder.

    Args:
        out: an explicit path (``--out``), used as given.
        publish: ``--publish``: the default goes under :data:`PUBLISH_DIR`.
        default_name: file or folder name of the output.
        root: the repository root the default folders are relative to.
    """
    if out is not None:
        return Path(out)
    return Path(root) / (PUBLISH_DIR if publish else OUT_DIR) / default_name


def provenance(root: str | Path = ".") -> dict[str, str]:
    """``{"commit": ..., "date": ...}`` of the checkout at ``root``: the short commit
    (marked when the tree has uncommitted changes, ``unknown`` outside git) and the UTC
    date of the run."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        commit = head.stdout.strip() if head.returncode == 0 else "unknown"
        if head.returncode == 0 and git("diff", "--quiet", "HEAD").returncode != 0:
            commit += " (with uncommitted changes)"
    except OSError:
        commit = "unknown"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"commit": commit, "date": date}


def write_json(path: str | Path, report: dict) -> Path:
    """Writes ``report`` as indented JSON to ``path`` (its folder made if missing) and
    says so on stdout; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return path
