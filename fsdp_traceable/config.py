"""Library-wide switches, as a torch config module (``config.patch(...)`` works).

``collectives_path``: which implementation of the foreach collectives runs.
    ``"auto"`` takes the traced path (functional collectives) while Dynamo or
    compiled autograd is tracing and the eager path (c10d, async work) otherwise;
    ``"traced"`` and ``"eager"`` force one path (the eager path cannot be traced).
``copy_kernels``: who implements the copy-in / copy-out ops (see
    :mod:`fsdp_traceable.collectives.copy_backends`). ``"auto"`` (default) picks the
    fastest measured one per device and copy: the Triton kernels on a GPU (eager, and
    per copy under compile), the aten ops elsewhere; ``"inductor"`` runs the aten
    decomposition (fused by Inductor under compile); ``"foreach"`` uses
    ``torch._foreach_copy_``-style kernels in eager; ``"triton"`` the fused kernels
    from ``triton_kernels``.
``backward_regions``: under compiled autograd, paste the AOT backward of each group
    compiled on its own (per-block compile) as one call of a nested compile region,
    so identical blocks share one traced and compiled backward (see
    :mod:`fsdp_traceable.backward_regions`). ``False`` pastes every block's backward
    node by node, as torch does.
``forward_regions`` (default ``None``: on where this torch's regions take a reuse key,
    2.13 on): while Dynamo traces ``backward()`` itself (``compile_step``, or
    ``torch._dynamo.config.trace_autograd_ops``), run each ``fully_shard`` module's own
    forward as one call of a shared nested compile region, so identical blocks are
    traced and compiled once (see :mod:`fsdp_traceable.fsdp.forward_regions`). Each
    collective is moved across the neighbouring region call, so a block's all-gather
    still overlaps the previous block's compute (:mod:`fsdp_traceable.whole_step.region_schedule`).
    A forward returning a view of its input, or an object other than tensors,
    constants and tuples, lists and dicts of them, fails to compile with an error
    naming this switch. ``True`` insists (``compile_step`` raises on an older torch);
    ``False`` traces every block's forward inline.
``max_bucket_bytes``: the largest all-gather output or reduce-scatter input one bucket
    (one ``fully_shard`` group) may plan, in bytes; larger buckets are rejected at
    ``fully_shard`` time and before any allocation in the collectives. The default,
    ``2**31 - 1`` (the largest int32 byte count), is a conservative cap; raise it
    where the backend handles larger messages.
"""

import sys

from torch.utils._config_module import install_config_module

collectives_path: str = "auto"
copy_kernels: str = "auto"
backward_regions: bool = True
forward_regions: bool | None = None
max_bucket_bytes: int = 2**31 - 1

install_config_module(sys.modules[__name__])
