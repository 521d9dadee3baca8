"""``python -m fsdp_traceable doctor``: what this install runs on and what it can do.

The versions (Python, torch, Triton, the package), what the package detects of this
torch (the same checks its entry points make), which ways of training it offers here,
and the package's torch patches: which are in place in this process when ``doctor``
starts (none in a fresh process: importing the package applies none), and which
``fully_shard``, ``compile_step`` and the others apply on this torch. To learn the
latter, ``doctor`` calls those entry points' patch functions in its own process, after
reading the former, and prints both.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from typing import Any


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _capabilities() -> dict[str, bool]:
    """The feature checks the package's entry points make, on this torch."""
    import torch

    from .. import _torch_patches, backward_regions, tracing
    from ..whole_step.capture import dynamo_traces_backward_into_dtensors
    from ..whole_step.step_cache import precompile_available

    return {
        "compiled_autograd": hasattr(torch._dynamo, "compiled_autograd"),
        "nested_compile_region": hasattr(torch.compiler, "nested_compile_region"),
        "regions_reuse_by_key": tracing.regions_available(),
        "outlined_block_backwards": backward_regions.supported(),
        "dynamo_traces_backward_into_dtensors": dynamo_traces_backward_into_dtensors(),
        "backward_into_subclasses_needs_patch": _torch_patches.subclass_patch_needed(),
        "precompile_save_load": precompile_available(),
        "cuda": torch.cuda.is_available(),
        "triton_importable": _version("triton") is not None,
    }


def _recipes(capabilities: dict[str, bool]) -> dict[str, bool]:
    """The ways of training the package offers, and whether this torch runs each."""
    from .. import config, tracing

    return {
        "eager": True,
        "per-block compile (torch.compile or module.compile() per block)": True,
        "compile + compiled autograd": capabilities["compiled_autograd"],
        "backward regions (one compiled backward per repeated block)":
            capabilities["outlined_block_backwards"] and bool(config.backward_regions),
        "whole step (compile_step)": capabilities["dynamo_traces_backward_into_dtensors"],
        "forward regions in the whole step": (
            capabilities["dynamo_traces_backward_into_dtensors"]
            and tracing.forward_regions_enabled()),
        "step cache (compile_step(cache_dir=...))": (
            capabilities["dynamo_traces_backward_into_dtensors"]
            and capabilities["precompile_save_load"]),
    }


def _apply_each_entry_points_patches() -> None:
    """Calls the patch functions of every entry point that applies patches."""
    from .. import _torch_patches, backward_regions
    from ..fsdp.fully_shard import _patch_torch as fully_shards_patches

    fully_shards_patches()
    _torch_patches.drop_mesh_hash_from_pickles()  # fully_shard: with its meshes, none here
    _torch_patches.allow_checkpointed_group_state()  # fully_shard: a sharded module checkpointed
    backward_regions.install(lambda compiled_function, bw_module: False)  # its first group
    _torch_patches.trace_backward_into_subclasses()
    _torch_patches.complete_whole_step_recompute()
    _torch_patches.answer_isa_load_checks()
    _torch_patches.skip_header_precompile_on_load()


def doctor_report() -> dict[str, Any]:
    """The report ``doctor`` prints.

    Returns:
        ``versions``, ``capabilities``, ``recipes``, and ``torch_patches``:
        ``in_place_at_start`` (names) and ``applied_here`` (entry point -> the patches it
        applies on this torch).
    """
    from .._torch_patches import inventory

    at_start = inventory.patches_in_place()  # before doctor imports or applies anything
    import torch

    capabilities = _capabilities()
    _apply_each_entry_points_patches()
    applied: dict[str, list[str]] = {}
    for name in inventory.patches_in_place():
        applied.setdefault(inventory.applied_by(name), []).append(name)
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "fsdp_traceable": _version("fsdp_traceable") or _version("fsdp-traceable"),
        },
        "capabilities": capabilities,
        "recipes": _recipes(capabilities),
        "torch_patches": {"in_place_at_start": at_start, "applied_here": applied},
    }


def format_report(report: dict[str, Any]) -> str:
    """``report`` as the text ``doctor`` prints."""
    versions = report["versions"]
    lines = ["versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()),
             "", "capabilities:"]
    lines += [f"  {'yes' if on else 'no ':3}  {name}" for name, on in report["capabilities"].items()]
    lines += ["", "recipes on this torch:"]
    lines += [f"  {'yes' if on else 'no ':3}  {name}" for name, on in report["recipes"].items()]
    patches = report["torch_patches"]
    at_start = patches["in_place_at_start"]
    lines += ["", "torch patches in place in this process when doctor started: "
              + (", ".join(at_start) if at_start
                 else "none (importing fsdp_traceable applies none)")]
    lines.append("torch patches each entry point applies on this torch (doctor applied "
                 "them in its own process to find out):")
    for entry_point, names in patches["applied_here"].items():
        lines.append(f"  {entry_point}: {', '.join(names)}")
    if not patches["applied_here"]:
        lines.append("  none")
    return "\n".join(lines)


def run_doctor(as_json: bool) -> int:
    """Prints the report (as JSON with ``as_json``).

    Args:
        as_json: print the report as one JSON object instead of text.

    Returns:
        The process exit code.
    """
    report = doctor_report()
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
