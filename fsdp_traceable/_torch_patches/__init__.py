"""Every change this package makes to torch itself, in one place: this package, one
module per area of torch (``dtensor``, ``device_mesh``, ``checkpoint_warning``,
``checkpointed_side_effects``, ``compiled_autograd``, ``whole_step_recompute``,
``regions``, ``autograd_function``, ``cpu_vec_isa``, ``precompiled_header``,
``traced_backward``; ``wrapping``: how a patch replaces a torch function).

[Note: torch patches]
Each patch below works around one torch behaviour that has no public switch. Each
has: a docstring saying why, which torch versions it applies to (feature-detected:
where torch lacks what it patches, nothing is changed and the function returns
``False``), and one function that applies it and is safe to call again. Each has a
test in ``tests/_torch_patches/`` (``test_<module>.py``) that checks the unpatched behaviour is still
a problem, so that test fails, and says the patch can go, once torch fixes it.

Importing ``fsdp_traceable`` applies none of them (``tests/test_import_side_effects.py``
compares torch before and after the import in a fresh process), nor imports Dynamo,
Inductor or Triton: each is applied by the package's own entry point that needs it.

* :func:`drop_mesh_hash_from_pickles`, :func:`skip_dtensor_unflatten_frames`,
  :func:`drop_context_fn_warning`, :func:`shard_uneven_new_empty_strided`,
  :func:`trust_fresh_outputs`, and where torch's regions take a reuse key,
  :func:`link_stamped_out_regions`, :func:`memoize_region_schemas`: on every
  ``fully_shard`` call (``fsdp/fully_shard._patch_torch``: the autograd boundary's,
  ``fsdp/autograd_bridge.patch_torch``, and the forward region's,
  ``fsdp/forward_regions.patch_torch``).
* :func:`allow_checkpointed_group_state`: by a ``fully_shard`` that links a root
  holding a ``checkpoint_wrapper`` around a sharded module
  (``fsdp/activation_checkpointing.inside_checkpoint_wrappers``).
* :func:`rewrite_aot_backwards`: on the first parameter group built
  (``backward_regions.install``, through ``fsdp/block_backward.py``).
* :func:`trace_backward_into_subclasses`, :func:`complete_whole_step_recompute`: by
  :func:`fsdp_traceable.compile_step`, and by a ``fully_shard`` forward that Dynamo
  traces with ``trace_autograd_ops`` on (``fsdp/traced_step_passes.py``); the latter
  acts on graphs holding the package's ops only.
* :func:`answer_isa_load_checks`: by :func:`isa_load_checks_answered`, where a saved
  step's CPU ISA probe outcome is taken (``whole_step.cpu_isa_probe.trust_saved_probe``).
* :func:`skip_header_precompile_on_load`: by :func:`header_precompile_skipped`, while
  a saved step loads (``whole_step.step_cache``).

No module outside this package may assign to, wrap or filter anything of torch's.
"""

from __future__ import annotations

from typing import Any

from .autograd_function import fresh_outputs, trust_fresh_outputs
from .checkpoint_warning import (
    CONTEXT_FN_WARNING,
    CONTEXT_FN_WARNING_LOGGER,
    drop_context_fn_warning,
    quiet_context_fn,
)
from .checkpointed_side_effects import (
    allow_checkpointed_group_state,
    allow_group_state_under_checkpoint,
)
from .compiled_autograd import extract_bw_module_exists, rewrite_aot_backwards
from .cpu_vec_isa import answer_isa_load_checks, isa_load_checks_answered
from .device_mesh import drop_mesh_hash_from_pickles
from .dtensor import shard_uneven_new_empty_strided, skip_dtensor_unflatten_frames
from .precompiled_header import header_precompile_skipped, skip_header_precompile_on_load
from .regions import link_stamped_out_regions, mark_package_compile, memoize_region_schemas
from .traced_backward import (
    dynamo_traces_backward,
    subclass_patch_needed,
    trace_backward_into_subclasses,
)

# Read from .whole_step_recompute on first use: it imports Inductor (through
# ..whole_step.region_schedule), which importing this package must not.
_LAZY = {"REMAT_PASS_MODULE", "complete_whole_step_recompute"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import whole_step_recompute

        return getattr(whole_step_recompute, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONTEXT_FN_WARNING",
    "allow_checkpointed_group_state",
    "allow_group_state_under_checkpoint",
    "CONTEXT_FN_WARNING_LOGGER",
    "REMAT_PASS_MODULE",
    "answer_isa_load_checks",
    "complete_whole_step_recompute",
    "drop_context_fn_warning",
    "drop_mesh_hash_from_pickles",
    "dynamo_traces_backward",
    "extract_bw_module_exists",
    "fresh_outputs",
    "header_precompile_skipped",
    "isa_load_checks_answered",
    "link_stamped_out_regions",
    "mark_package_compile",
    "memoize_region_schemas",
    "quiet_context_fn",
    "rewrite_aot_backwards",
    "shard_uneven_new_empty_strided",
    "skip_header_precompile_on_load",
    "skip_dtensor_unflatten_frames",
    "subclass_patch_needed",
    "trace_backward_into_subclasses",
    "trust_fresh_outputs",
]
