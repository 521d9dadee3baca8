"""The package's import graph: no cycles between modules, no import of a higher layer.

Read from the source with ``ast``: every ``import``, also inside functions and under
``if TYPE_CHECKING:``, so a lazy import or an annotation's import that would close a
cycle counts as much as a top-level one (a lower module that must name a higher one's
class takes a ``Protocol`` of what it calls instead).
"""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp_traceable

PACKAGE = "fsdp_traceable"
ROOT = Path(fsdp_traceable.__file__).parent

# Lowest first; a module may import its own layer and the layers below it. Keyed by
# the first name under the package (a base module's own name, or a subpackage).
# whole_step/ holds the whole step's modules of several layers: each is keyed by its own
# name (``whole_step.<module>``), the package's lazy ``__init__`` by ``whole_step``.
LAYERS: list[tuple[str, ...]] = [
    ("config", "sizes", "tracing", "fx_ops", "_torch_patches", "profiler_labels",
     "_source_tree", "_command_line", "traced_errors", "whole_step.region_schedule",
     "whole_step.cpu_isa_probe", "whole_step.inductor_options", "whole_step.graph_pass_key"),
    ("triton_kernels",),  # the top-level triton_kernels/ folder, imported under the package
    ("collectives", "whole_step.copy_regions"),
    ("backward_regions",),
    # "": the package's __init__, which re-exports fully_shard
    ("fsdp", "", "whole_step", "whole_step.capture", "whole_step.step_cache",
     "whole_step.traced_optimizer"),
    ("models",),
    ("plan",),  # the planner: fsdp and models on fake tensors
    ("introspection",),
    ("testing",),
    ("cli", "__main__"),
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name imported from a package that
    is one of its modules counts as that module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in modules else source)
        graph[name] = {t for t in targets if t != name}
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else ""
    if key == "whole_step" and len(parts) > 2:
        key = f"whole_step.{parts[2]}"
    assert key in LAYER_OF, f"{module}: give {key!r} a layer in LAYERS (tests/test_import_layers.py)"
    return LAYER_OF[key]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "fsdp_traceable.collectives.comm" in graph["fsdp_traceable.fsdp.autograd_bridge"]
    assert "fsdp_traceable._torch_patches" in graph["fsdp_traceable.fsdp.fully_shard"]


def test_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} (layer {layer(module)}) -> {target} (layer {layer(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]
    assert upward == []


def test_fsdp_features_import_nothing_of_the_core() -> None:
    # The opt-in parts sit below the core that calls them (fsdp/features/__init__.py).
    features = f"{PACKAGE}.fsdp.features"
    into_core = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items()) if module.startswith(features)
        for target in sorted(targets)
        if target.startswith(f"{PACKAGE}.fsdp.") and not target.startswith(features)
    ]
    assert into_core == []
