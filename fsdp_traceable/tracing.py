"""The one answer to "is this code being traced right now?".

The collectives take functional collectives and the copies take traceable kernels
while Dynamo, compiled autograd, AOTAutograd or ``make_fx`` trace them, and their
eager implementations (c10d work, data pointers, ``out=`` buffers) otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor


def is_tracing(tensors: Sequence[torch.Tensor] = ()) -> bool:
    """Whether a compiler is tracing this call: Dynamo is compiling, a proxy
    (``make_fx``) mode is active, or any of ``tensors`` is a fake or functional tensor
    (no data to read)."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return True
    return any(is_fake(t) or isinstance(t, FunctionalTensor) for t in tensors)
