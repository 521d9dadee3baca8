"""FSDP2's public surface next to ours, as the API table of ``docs/api.md``.

Introspects both libraries: a row per FSDP2 name (``torch.distributed.fsdp``'s FSDP2
exports, and every public method of its ``FSDPModule``), with its status computed, not
written: *same* (our signature equals FSDP2's, or torch's own object serves), *differs*
(implemented, with the difference stated in :data:`DIFFERENCES`) or *missing* (raises
``NotImplementedError``). ``python -m tests.fsdp.api_surface`` prints the table, then
the late-attachment table (:data:`LATE_ATTACHMENT`: what a user changes or attaches after ``fully_shard``);
``tests/fsdp/test_api_surface.py`` checks ``docs/api.md`` holds both.
"""

from __future__ import annotations

import inspect

import torch.distributed.fsdp as fsdp2

import fsdp_traceable

# FSDP2's exports in torch.distributed.fsdp (the rest of __all__ is FSDP1's API).
FSDP2_EXPORTS = (
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx", "DataParallelMeshDims",
)

# torch's own objects that work with our modules as they are (checked by the parity tests).
TORCH_OBJECTS_THAT_SERVE = {
    "MixedPrecisionPolicy": "torch's class (also exported as `fsdp_traceable.MixedPrecisionPolicy`)",
    "OffloadPolicy": "torch's class, accepted by `offload_policy=`",
    "CPUOffloadPolicy": "torch's class: parameters, gradients and optimizer state on CPU",
    "UnshardHandle": "torch's class: `unshard(async_op=True)` returns a subclass",
    "register_fsdp_forward_method": "torch's function works on our modules",
    "share_comm_ctx": "torch's function works on our modules: their groups share one "
                      "copy-in stream",
    "DataParallelMeshDims": "torch's class (torch 2.12+), accepted by `dp_mesh_dims=`",
}

# Implemented, with a difference from FSDP2 a user can see.
DIFFERENCES = {
    "fully_shard": "an int `reshard_after_forward` other than 1 or the shard size, "
                   "compiled, all-gathers in forward in two steps (across the groups of N "
                   "ranks, then within one) and raises `NotImplementedError` with "
                   "all-gather extensions; a "
                   "`ShardPlacementResult` on another mesh raises `NotImplementedError`; "
                   "`dp_mesh_dims` takes one shard dim (several, or none, raise "
                   "`NotImplementedError`) and runs eagerly only (compiled, it raises "
                   "`NotImplementedError`)",
    "set_is_last_backward": "accepted and ignored: our backward leaves no reduction pending",
    "set_gradient_divide_factor": "a factor other than the shard size sums, then divides the "
                                  "output (FSDP2 uses NCCL's `premul_sum`; the numbers equal "
                                  "its sum-only ones)",
    "set_modules_to_forward_prefetch": "eager; a non-empty list raises under `torch.compile` "
                                       "(Inductor places the all-gathers)",
    "set_modules_to_backward_prefetch": "eager; a non-empty list raises under `torch.compile` "
                                        "(Inductor places the all-gathers)",
    "set_requires_all_reduce": "`False` raises under a compiled backward (run those "
                               "microbatches eagerly)",
    "set_all_reduce_hook": "`stream=` raises under a compiled backward",
    "set_post_optim_event": "eager: the next copy-in of every group below waits on the event; a "
                            "compiled graph's all-gathers already follow the optimizer on "
                            "the current stream",
    "set_allocate_memory_from_process_group_for_comm": "eager, through FSDP2's own comms; "
        "raises under `torch.compile` (Inductor allocates the buffers there)",
    "set_symm_mem_for_comm": "eager, through FSDP2's own comms (raising as FSDP2 where the "
                             "backend is unavailable); raises under `torch.compile`",
    "set_custom_all_gather": "eager; raises under `torch.compile` (functional collectives "
                             "there)",
    "set_custom_reduce_scatter": "eager; raises under a compiled backward; our copy-in is "
                                 "copied into the input buffer `allocate` returns",
    "set_unshard_in_backward": "our backward all-gathers only what it reads; `False` on a "
                               "module whose backward reads its parameters raises",
    "set_requires_gradient_sync": "`False` raises under a compiled backward, or while a "
                                  "module below was compiled by itself (run no-sync "
                                  "microbatches eagerly)",
}

# Why a missing name is missing (default: it reads FSDP2's internal state).
MISSING_BECAUSE: dict[str, str] = {}
_DEFAULT_MISSING = "not implemented yet; raises `NotImplementedError`"


def _same_signature(theirs: object, ours: object) -> bool:
    def params(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    try:
        return params(theirs) == params(ours)
    except (TypeError, ValueError):
        return False


def _is_unsupported(method: object) -> bool:
    return "_unsupported" in getattr(method, "__qualname__", "")


def rows() -> list[tuple[str, str, str]]:
    """``(name, status, note)`` for every FSDP2 export and ``FSDPModule`` method."""
    table = []
    for name in FSDP2_EXPORTS:
        if name in TORCH_OBJECTS_THAT_SERVE:
            table.append((f"`{name}`", "same", TORCH_OBJECTS_THAT_SERVE[name]))
        elif name in MISSING_BECAUSE:
            table.append((f"`{name}`", "missing", MISSING_BECAUSE[name]))
        else:
            ours = getattr(fsdp_traceable, name)
            same = _same_signature(getattr(fsdp2, name), ours) if callable(ours) else False
            status = "differs" if name in DIFFERENCES or not same else "same"
            table.append((f"`{name}`", status, DIFFERENCES.get(name, "")))
    for name, theirs in sorted(vars(fsdp2.FSDPModule).items()):
        if name.startswith("_") or not callable(theirs):
            continue
        ours = getattr(fsdp_traceable.FSDPModule, name)
        if _is_unsupported(ours):
            table.append((f"`FSDPModule.{name}`", "missing",
                          MISSING_BECAUSE.get(name, _DEFAULT_MISSING)))
            continue
        same = _same_signature(theirs, ours)
        status = "differs" if name in DIFFERENCES or not same else "same"
        note = DIFFERENCES.get(name, "" if same else "signature differs")
        table.append((f"`FSDPModule.{name}`", status, note))
    return table


# What a user changes or attaches after fully_shard: (what, status, how, proof). The
# proof is a case of tests/fsdp/late_attachment_cases.py (against FSDP2, 2 gloo ranks,
# bitwise) or a test file; tests/fsdp/test_api_surface.py checks each one exists.
LATE_ATTACHMENT = [
    ("`p.requires_grad_(False)` / `(True)` between steps", "same",
     "read at every all-gather, as FSDP2: a frozen parameter gets no gradient",
     "freeze_between_steps"),
    ("`register_forward_pre_hook` before `fully_shard`, or after it", "same",
     "runs after the unshard: sees the unsharded parameters and the cast inputs; "
     "after `fully_shard` with `prepend=True`: before it (sharded parameters)",
     "module_hooks"),
    ("`register_forward_hook` before `fully_shard`, or after it", "same",
     "registered before `fully_shard` or with `prepend=True`: runs before the reshard "
     "(unsharded parameters); otherwise after it", "module_hooks"),
    ("`register_full_backward_hook`", "differs",
     "same gradients; where `mp_policy` casts the module's own floating-point inputs, "
     "`grad_input` is taken before that cast (FSDP2: after it)",
     "tests/fsdp/test_late_attachment.py"),
    ("`Tensor.register_post_accumulate_grad_hook` on a sharded parameter", "same",
     "runs once per reduction, on the sharded `.grad`; not in no-sync microbatches",
     "post_accumulate_grad_hook"),
    ("`set_reshard_after_forward` / `_backward`, `set_gradient_divide_factor`, "
     "`set_reduce_scatter_divide_factor`, `set_modules_to_forward_prefetch` between steps",
     "same", "take effect at the next forward or backward", "settings_between_steps"),
    ("`set_all_reduce_hook`, `set_post_optim_event` between steps", "same",
     "read at each reduction / the next copy-in (the parity test sets them before the "
     "first step)", "tests/fsdp/test_module_settings_parity.py"),
    ("`module.weight = nn.Parameter(DTensor)` before the first forward", "same",
     "adopted (same layout required)", "replace_before_first_forward"),
    ("`module.weight = nn.Parameter(DTensor)` after the first forward", "differs",
     "ours adopts it at the assignment; FSDP2 (by its code: its lazy init has run) keeps "
     "gathering the old parameter and puts it back on the module at its next reshard",
     "replace_between_steps"),
    ("`module.weight = ` a plain `nn.Parameter`, `None`, or another layout", "differs",
     "`TypeError` / `ValueError` at the assignment, naming the parameter and the fix "
     "(FSDP2: `AttributeError` at the first forward)", "replace_with_plain_parameter"),
    ("`load_state_dict(state, assign=True)` between steps", "same",
     "the loaded parameters are adopted", "load_state_dict_assign"),
    ("`module.to(dtype)` / `module.float()` after `fully_shard`", "same",
     "parameters re-read", "to_dtype_before_forward"),
    ("`module.apply(init_fn)` between steps", "same", "in place on the shards",
     "apply_init_between_steps"),
    ("`module.forward = fn` on the instance (torchtitan's `Module.parallelize` sets one), "
     "before or after `fully_shard`", "same",
     "runs inside the group's forward, between the unshard and the reshard; "
     "`del module.forward` restores the class's", "tests/fsdp/test_late_attachment.py"),
    ("meta device: `to_empty(device=...)`, then `init_weights`", "same",
     "parameters re-read", "tests/fsdp/test_meta_init_parity.py"),
    ("meta device: a forward before `to_empty`", "same",
     "FSDP2's `RuntimeError` before the group's first all-gather",
     "tests/fsdp/test_late_attachment.py"),
    ("`fsdp_pre_all_gather` / `fsdp_post_all_gather` set on a local shard", "same",
     "looked up at every all-gather", "tests/fsdp/features/test_all_gather_extensions.py"),
]


def late_attachment_table() -> str:
    """The late-attachment table of ``docs/api.md``, as markdown."""
    lines = ["| after `fully_shard` | ours | how | proof |", "|---|---|---|---|"]
    for what, status, how, proof in LATE_ATTACHMENT:
        proof = f"`{proof}`" if proof.startswith("tests/") else f"`{proof}` case"
        lines.append(f"| {what} | {status} | {how} | {proof} |")
    return "\n".join(lines) + "\n"


def api_table() -> str:
    """The API table of ``docs/api.md``, as markdown."""
    lines = ["| FSDP2 | ours | how / why |", "|---|---|---|"]
    lines += [f"| {name} | {status} | {note} |" for name, status, note in rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(api_table())
    print(late_attachment_table(), end="")
