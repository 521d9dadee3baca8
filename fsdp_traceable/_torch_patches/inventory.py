"""Which of the package's torch patches are in place in this process, read from torch.

Each patch leaves its mark on what it replaced (the attribute ``wrapping.wrap_once``
sets on its wrapper, or the patch module's own record); this module reads those marks
and imports nothing: a patch whose torch module is not imported yet is not in place.
``python -m fsdp_traceable doctor`` reports them; ``tests/cli/test_doctor.py`` keeps this
table equal to the patches the package's ``__init__`` lists and to what each patch
function answers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

# The package's entry points that apply patches ([Note: torch patches]).
FULLY_SHARD = "fully_shard"
COMPILE_STEP = "compile_step"
SAVED_STEP = "a saved step's load"


@dataclass(frozen=True)
class PatchMark:
    """Where one patch leaves its mark.

    Attributes:
        name: the function of :mod:`fsdp_traceable._torch_patches` that applies it.
        applied_by: the package's entry point that calls it.
        module: the torch module holding what it replaces.
        owner: the class there holding it, or ``None`` for the module itself.
        attribute: what it replaces.
        marker: the attribute its replacement carries.
    """

    name: str
    applied_by: str
    module: str
    owner: str | None
    attribute: str
    marker: str

    def in_place(self) -> bool:
        """Whether torch holds this patch's replacement now (imports nothing)."""
        holder: Any = sys.modules.get(self.module)
        if holder is not None and self.owner is not None:
            holder = vars(holder).get(self.owner)
        replaced = None if holder is None else getattr(holder, self.attribute, None)
        return bool(getattr(replaced, self.marker, False))


_REMAT = "torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass"

MARKS = (
    PatchMark("drop_mesh_hash_from_pickles", FULLY_SHARD, "torch.distributed.device_mesh",
              "DeviceMesh", "__getstate__", "_fsdp_traceable_drops_hash"),
    PatchMark("drop_context_fn_warning", FULLY_SHARD, "torch._higher_order_ops.wrap", None,
              "warning_once", "_fsdp_traceable_skips_quiet"),
    PatchMark("trust_fresh_outputs", FULLY_SHARD, "torch._functorch.autograd_function",
              "DynamoAutogradFunctionTraceHelper", "fwd_trace_helper", "_fsdp_traceable_trusts"),
    PatchMark("link_stamped_out_regions", FULLY_SHARD, "torch._dynamo.variables.invoke_subgraph",
              None, "stamp_out_subgraph", "_fsdp_traceable_links"),
    PatchMark("memoize_region_schemas", FULLY_SHARD, "torch._higher_order_ops.invoke_subgraph",
              "InvokeSubgraphHOP", "gen_schema", "_fsdp_traceable_memo"),
    # fully_shard's root linking, for a checkpoint_wrapper around a sharded module.
    PatchMark("allow_checkpointed_group_state", FULLY_SHARD,
              "torch._dynamo.variables.higher_order_ops", "CheckpointHigherOrderVariable",
              "_call_function", "_fsdp_traceable_allows_sharded"),
    # fully_shard's first parameter group installs backward regions.
    PatchMark("rewrite_aot_backwards", FULLY_SHARD, "torch._dynamo.compiled_autograd",
              None, "extract_bw_module", "_fsdp_traceable_rewrite"),
    PatchMark("trace_backward_into_subclasses", COMPILE_STEP, "torch._dynamo.variables.torch",
              None, "_collect_tensors_with_sources", "_fsdp_traceable_takes_subclasses"),
    PatchMark("complete_whole_step_recompute", COMPILE_STEP, _REMAT, None,
              "remat_using_tags_for_fwd_loss_bwd_graph", "_fsdp_traceable_completes"),
    PatchMark("answer_isa_load_checks", SAVED_STEP, "torch._inductor.cpu_vec_isa", "VecISA",
              "_probe_load", "_fsdp_traceable_answers"),
    PatchMark("skip_header_precompile_on_load", SAVED_STEP, "torch._inductor.codecache", None,
              "_precompile_header", "_fsdp_traceable_skips"),
)

# Applied by fully_shard too; recorded by their module rather than marked on torch.
RECORDED = ("skip_dtensor_unflatten_frames", "shard_uneven_new_empty_strided")


def applied_by(name: str) -> str:
    """The package's entry point that applies the patch ``name``."""
    if name in RECORDED:
        return FULLY_SHARD
    return next(mark.applied_by for mark in MARKS if mark.name == name)


def patch_names() -> list[str]:
    """Every patch, by the function that applies it."""
    return [*(mark.name for mark in MARKS), *RECORDED]


def patches_in_place() -> list[str]:
    """The patches in place in this process now, by the function that applied them.

    Returns:
        Their names, in :func:`patch_names`'s order; empty in a process that called
        none of the package's entry points (importing the package applies none).
    """
    recorded = sys.modules.get(f"{__package__}.dtensor")
    applied = getattr(recorded, "_applied", set())
    return [*(mark.name for mark in MARKS if mark.in_place()),
            *(name for name in RECORDED if name in applied)]
