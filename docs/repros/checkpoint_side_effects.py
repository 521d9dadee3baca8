"""Dynamo refuses a checkpointed module whose forward changes Python state and then
undoes it (torch 2.11 to 2.15).

A ``fully_shard`` module's traced forward binds its unsharded parameters to the module
and unbinds them before it returns: the state before and after the forward is the same,
so the recompute in backward has nothing to redo. Dynamo traces ``checkpoint`` as one
higher-order op and refuses any mutation inside it ("HOP: Unsafe side effect"); its
only switch, ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``, is
global, so turning it on would also let any other checkpointed code drop its side
effects silently. fsdp_traceable allows side effects for checkpoints of modules that
hold its sharded modules only (``_torch_patches.allow_checkpointed_group_state``).
No fsdp_traceable code is involved.

Run: python docs/repros/checkpoint_side_effects.py
Prints Dynamo's refusal, then the output shape with the global switch on
(torch 2.13: "Unsupported: HOP: Unsafe side effect ...", then (2, 4)).
"""

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


class BindsAndUnbinds(nn.Module):
    """Stands for a sharded module: its forward puts a tensor in a dict and takes it out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bound: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bound["weight"] = self.lin.weight * 1.0
        out = x @ self.bound["weight"].t()
        del self.bound["weight"]
        return out


model = checkpoint_wrapper(BindsAndUnbinds())
try:
    torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(2, 4))
except torch._dynamo.exc.Unsupported as error:
    print("Unsupported:", str(error).splitlines()[0])
torch._dynamo.reset()
with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(2, 4))
print(tuple(out.shape))
