"""Hugging Face ``LlamaForCausalLM`` (tiny config, no weights) against torch's FSDP2 on
2 and 3 gloo ranks: built on meta, ``fully_shard`` per decoder layer and at the root,
``to_empty``, one seed's init, 3 AdamW steps; losses and parameters bit for bit."""

from __future__ import annotations

import pytest

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases

pytest.importorskip("transformers")


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 3])
def test_llama_from_meta_trains_like_fsdp2(world_size: int):
    cases = [("llama", parity_cases.llama_meta_init, ())]
    for rank, per_rank in enumerate(run_on_local_ranks(run_cases, world_size, cases,
                                                       timeout_s=300)):
        result = per_rank["llama"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        assert result["ours"]["losses"] == result["theirs"]["losses"]
        assert_bitwise(result["theirs"]["params"], result["ours"]["params"], "parameters")
