"""count_inlined_calls: every call Dynamo inlines, and the outermost ones timed."""

from __future__ import annotations

from collections import Counter

import torch

from fsdp_traceable.introspection.inlined_calls import count_inlined_calls


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _outer(x: torch.Tensor) -> torch.Tensor:
    return _inner(x) + _inner(x)


def test_counts_every_inlined_call_and_times_only_the_outermost() -> None:
    torch._dynamo.reset()
    outermost: Counter[str] = Counter()
    compiled = torch.compile(lambda x: _outer(x) - 1, backend="eager", fullgraph=True)
    with count_inlined_calls(outermost) as counts:
        compiled(torch.ones(3))
    by_name = {name.split(" ")[0]: n for name, n in counts.items()}
    assert by_name == {"_outer": 1, "_inner": 2}
    # _inner runs inside _outer: its time is part of _outer's, not a key of its own.
    assert [name.split(" ")[0] for name in outermost] == ["_outer"]
    assert all(seconds >= 0 for seconds in outermost.values())
    # Without the counter, counting alone.
    torch._dynamo.reset()
    with count_inlined_calls() as counts:
        compiled(torch.ones(3))
    assert sum(counts.values()) == 3
