"""Inductor settings for compiling a ``fully_shard``-ed model.

Pass them per compile, so nothing global changes::

    options = fsdp_traceable.inductor_options()
    loss_fn = torch.compile(model.loss, fullgraph=True, options=options)
    with torch._dynamo.compiled_autograd._enable(torch.compile(options=options)):
        loss_fn(tokens, targets).backward()

With Inductor's defaults, every group's copy-in and copy-out is one kernel already, but
each all-gather is waited for right after it is issued, and Inductor's peak-memory
reordering moves the gradients' copies into the reduce-scatter input up to the kernels
that compute them (several copy kernels per group, each gradient freed early).
"""

from __future__ import annotations

__all__ = ["OVERLAP_PASSES", "SINK_WAITS_ONLY", "inductor_options"]

# Inductor's passes that move collectives for overlap, in the order they run.
OVERLAP_PASSES = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")
# Of those, the one that only delays waits (see ``raise_collectives``).
SINK_WAITS_ONLY = ("sink_waits",)


def inductor_options(
    *, overlap: bool = True, group_copy_kernels: bool = True, exact_casts: bool = True,
    raise_collectives: bool = True,
) -> dict[str, object]:
    """Inductor config for ``torch.compile(..., options=...)``.

    Args:
        overlap: issue each all-gather before compute it does not depend on and wait
            for it only where its output is first needed (Inductor's compute/comm
            overlap passes, off by default), so a block's all-gather runs during the
            previous block's matmuls, in forward and in backward.
        group_copy_kernels: pack each group's gradients for its reduce-scatter with one
            kernel, after the group's last gradient is computed, by turning off
            Inductor's peak-memory reordering. That keeps every gradient of the group
            alive until the copy: the memory FSDP2's eager reduce-scatter holds too.
            With ``overlap`` on as well, the overlap reordering can still split a
            group's packing (two kernels per transformer block in
            ``compile_tests/test_inductor_code.py``).
        exact_casts: round every cast to a lower precision where the code casts, as
            eager does (Inductor's ``emulate_precision_casts``). By default Inductor
            keeps a fused cast-then-divide in fp32, so the fp16 reduce-scatter
            copy-in with a pre-divide differs from eager (and FSDP2) where eager's
            cast overflows to inf or its quotient is subnormal; with this on, the
            compiled copy is bitwise the eager one
            (``tests/collectives/test_predivide_rounding.py``).

        raise_collectives: with ``overlap``, also issue every collective as early as its
            inputs allow (``raise_comms``, ``reorder_compute_for_overlap``), and in
            compiled autograd's backward of per-block compiled blocks, where
            Inductor's passes leave each re-gather right before its own block's
            backward region, issue each re-gather one block ahead
            (:class:`fsdp_traceable.region_schedule.CompiledAutogradOverlap`, set as
            ``post_grad_custom_post_pass``: to add a pass of your own, chain the two);
            ``False``
            keeps each where the program issues it and only delays its wait. Use
            ``False`` with :func:`fsdp_traceable.compile_step`: there a resharded
            group's re-gather in backward reads only the sharded parameters, so raising
            it moves it to the start of the forward, and that group's unsharded
            parameters stay alive through the whole forward
            (``compile_tests/test_inductor_code.py``).

    Returns:
        The settings, a ``dict`` of Inductor config names to values (empty when all
        are off).
    """
    switches = (("overlap", overlap), ("group_copy_kernels", group_copy_kernels),
                ("exact_casts", exact_casts), ("raise_collectives", raise_collectives))
    for name, value in switches:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    options: dict[str, object] = {}
    if overlap:
        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = list(
            OVERLAP_PASSES if raise_collectives else SINK_WAITS_ONLY)
        if raise_collectives:
            # Not on import: a CustomGraphPass imports Inductor (and Dynamo, Triton).
            from .region_schedule import CompiledAutogradOverlap

            options["post_grad_custom_post_pass"] = CompiledAutogradOverlap()
    if group_copy_kernels:
        options["reorder_for_peak_memory"] = False
    if exact_casts:
        options["emulate_precision_casts"] = True
    return options
