"""The standalone repros the patch table of ``docs/design.md`` links (``docs/repros/``):
each exists, parses, says how to run it, and imports nothing of the package. Run by
hand (``python docs/repros/<file>``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_linked_repro_runs_without_the_package() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("## Patches of torch"):design.index("## Profiler labels")]
    linked = sorted(set(re.findall(r"\(repros/([\w.]+\.py)\)", table)))
    assert len(linked) >= 10
    for name in linked:
        path = ROOT / "docs" / "repros" / name
        tree = ast.parse(path.read_text(), str(path))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}
        assert not any(module.split(".")[0] == "fsdp_traceable" for module in imported), name
        assert f"Run: python docs/repros/{name}" in (ast.get_docstring(tree) or ""), name
