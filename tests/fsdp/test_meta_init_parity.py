"""Meta-device init against torch's FSDP2 on 2 and 3 gloo ranks, uneven shards.

Built under ``torch.device("meta")``, sharded the torchtitan way (blocks, ``[norm,
output]``, root), ``to_empty(device="cpu")``, then initialized from one seed by every
module's ``reset_parameters()`` or by a torchtitan-style ``init_weights``: the same
local shards as FSDP2's, bit for bit, and the same 3 AdamW steps.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases

HOW = ("reset_parameters", "init_weights")


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict[str, Any]]:
    cases = [(how, parity_cases.meta_init, (how,)) for how in HOW]
    return run_on_local_ranks(run_cases, request.param, cases, timeout_s=300)


@pytest.mark.gloo
@pytest.mark.parametrize("how", HOW)
def test_meta_init_gives_fsdp2s_shards_and_training(ranks, how: str):
    for rank, per_rank in enumerate(ranks):
        result = per_rank[how]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        theirs, ours = result["theirs"], result["ours"]
        assert ours["devices"] == ["cpu"]
        assert_bitwise(theirs["initial"], ours["initial"], "initialized local shards")
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients")
        assert_bitwise(theirs["params"], ours["params"], "parameters after 3 steps")
