"""Parameters gathered outside functorch transforms, as FSDP2 gathers them.

[Note: functorch transforms]
FSDP2 (torch 2.13+) runs its unshard, wait and reshard with functorch disabled, so a
module's first forward inside ``torch.func.jvp`` (or ``vmap``, ``grad``) gathers plain
parameters: the transform sees them as constants (a zero tangent, for ``jvp``), and
autograd outside the transform still reaches the sharded parameters. Our gather is an
``autograd.Function`` (``autograd_bridge.UnshardParams``), which torch refuses to apply
while a transform is active unless it defines ``setup_context`` and the transform's
rule; eagerly it is applied with the transform stack set aside instead, to the same
effect. Traced, the call is left to the compiler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

try:  # torch 2.11 to 2.15 have it; feature-detected all the same
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
except ImportError:  # pragma: no cover
    temporarily_clear_interpreter_stack = None

F = TypeVar("F", bound=Callable[..., Any])


def outside_functorch_transforms(fn: F) -> F:
    """Runs ``fn`` with any active functorch transforms set aside (eager calls only);
    see [Note: functorch transforms].

    Args:
        fn: the function that gathers a group's parameters.

    Returns:
        ``fn``, wrapped.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if (torch.compiler.is_compiling() or temporarily_clear_interpreter_stack is None
                or not torch._C._are_functorch_transforms_active()):
            return fn(*args, **kwargs)
        with temporarily_clear_interpreter_stack():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
