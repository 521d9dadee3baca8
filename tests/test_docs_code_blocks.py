"""Every Python block of README.md and docs/*.md says what it is, on the line before it
(or at that line's end): ``<!-- quickstart -->`` (run by ``test_readme_quickstart``),
``<!-- fragment -->`` (a piece of a program: it must still parse), or ``<!-- runs:
torchrun --nproc-per-node N -->`` (a whole program: it is run so, on N gloo ranks, and
must exit 0). A block added without a marker fails here, so no doc can drift silently."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_traceable.testing.local_ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- (quickstart|fragment|runs: torchrun --nproc-per-node (\d+)) -->\s*$")


def code_blocks() -> list[tuple[str, str, str | None, int | None]]:
    """``(where, code, kind, ranks)`` for every ```python block of the docs."""
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            before = next((lines[i] for i in range(number - 1, -1, -1) if lines[i].strip()), "")
            match = MARKER.search(before)
            end = next(i for i in range(number + 1, len(lines)) if lines[i].startswith("```"))
            code = "\n".join(lines[number + 1 : end]) + "\n"
            where = f"{path.relative_to(ROOT)}:{number + 1}"
            kind = None if match is None else match.group(1).split(":")[0]
            ranks = int(match.group(2)) if match and match.group(2) else None
            blocks.append((where, code, kind, ranks))
    return blocks


BLOCKS = code_blocks()


@pytest.mark.parametrize("where, code, kind, ranks", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_block_is_marked_and_parses(where, code, kind, ranks) -> None:
    assert kind is not None, (
        f"{where}: mark the block <!-- fragment -->, or <!-- runs: torchrun "
        "--nproc-per-node N --> if it is a whole program")
    compile(code, where, "exec")


RUNNABLE = [b for b in BLOCKS if b[2] == "runs"]


@pytest.mark.gloo
@pytest.mark.parametrize("where, code, kind, ranks", RUNNABLE, ids=[b[0] for b in RUNNABLE])
def test_whole_programs_run_as_written(where, code, kind, ranks, tmp_path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
         f"--master-port={free_port()}", str(script)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"
