"""The models ``plan`` builds besides the built-in transformer: a Hugging Face config
(offline), a ``module:function``, and activation checkpointing's effect."""

from __future__ import annotations

import json

import pytest
import torch.nn as nn

from fsdp_traceable.plan.extrapolate import make_plan
from fsdp_traceable.plan.models import ShardSettings, model_source
from fsdp_traceable.plan.trace import Workload

WORKLOAD = Workload(batch_size=2, seq_len=16)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                  nn.Linear(32, 16)) for _ in range(3))
        self.out = nn.Linear(16, 64)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def blocks_model() -> nn.Module:
    return _Blocks()


def test_a_module_function_is_traced_whole_with_every_block_sharded() -> None:
    source = model_source(f"{__name__}:blocks_model", vocab_size=64)
    plan = make_plan(source, 4, ShardSettings(param_dtype="fp32"), WORKLOAD)
    n_params = sum(p.numel() for p in _Blocks().parameters())
    assert plan.params_bytes == n_params * 4 // 4  # fp32, evenly over 4 ranks
    assert plan.traced_depths == (0,)  # the function's own depth: traced as built
    assert plan.collectives[("reduce-scatter", "blocks.*", "backward", 4)][0] == 3


def test_a_hugging_face_config_file_plans_offline(tmp_path) -> None:
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    source = model_source(str(path))
    assert source.depth == 3
    plan = make_plan(source, 4, ShardSettings(param_dtype="fp32"), WORKLOAD)
    # 3 blocks of q, k, v, o, gate, up, down and two norms, the embedding, the output
    # and the final norm (untied), fp32 over 4 ranks.
    block = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32
    assert plan.params_bytes == (3 * block + 2 * 128 * 32 + 32) * 4 // 4
    assert plan.collectives[("all-gather", "model.layers.*", "forward", 4)][0] == 3


def test_a_name_not_cached_offline_says_to_pass_a_config_file() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="config.json"):
        model_source("no-such-org/no-such-model-for-plan")


def test_activation_checkpointing_keeps_fewer_activations() -> None:
    kept = {}
    for ac in ("none", "selective", "full"):
        source = model_source("transformer", layers=2, dim=32, heads=4, vocab_size=64,
                              seq_len=16)
        plan = make_plan(source, 2, ShardSettings(ac=ac), WORKLOAD)
        kept[ac] = plan.phase_peaks["forward"]
    assert kept["none"] > kept["selective"] > kept["full"]
