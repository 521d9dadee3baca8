"""torch warns about ``checkpoint(context_fn=...)`` under compile once per process
(torch 2.13 to 2.15).

``torch._higher_order_ops.wrap`` logs "Detected that context_fn is passed to
torch.utils.checkpoint under torch.compile..." through ``warning_once``, a
``functools.cache``: the first compiled selective checkpoint in the process logs it and
uses it up, so a library's own selective checkpoint (fsdp_traceable recomputes each
group's all-gather in backward with one, which has no in-place op) hides the warning
from the user's own code compiled later. fsdp_traceable skips the warning for the regions
it marks only (``_torch_patches.drop_context_fn_warning``). No fsdp_traceable code is
involved.

Run: python docs/repros/checkpoint_context_fn_warning.py
Prints how many times the warning was logged for two different compiled functions
(torch 2.13: 1, the second function's is never logged).
"""

import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

messages = []


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        messages.append(record.getMessage())


logging.getLogger("torch._higher_order_ops.wrap").addHandler(Keep())


def recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def context_fn():
    return create_selective_checkpoint_contexts(recompute_all)


def library_step(x):  # a library's own region, compiled first
    return checkpoint(torch.sin, x, use_reentrant=False, context_fn=context_fn).sum()


def users_step(x):  # the user's own, compiled after
    return checkpoint(torch.cos, x, use_reentrant=False, context_fn=context_fn).sum()


x = torch.randn(8, requires_grad=True)
for fn in (library_step, users_step):
    torch.compile(fn, backend="aot_eager", fullgraph=True)(x).backward()
print("context_fn warnings logged:", sum("context_fn" in m for m in messages))
