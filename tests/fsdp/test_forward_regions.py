"""The reuse key of forward regions (``fsdp_traceable/fsdp/forward_regions.py``): which
``fully_shard`` modules share one traced region, read from the real modules, on the
fake process group without compiling. The regions themselves, compiled: see
``compile_tests/test_whole_step.py`` and ``compile_tests/test_inductor_code.py``."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import fsdp_traceable
from fsdp_traceable.fsdp import forward_regions
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer

CONFIG = TransformerConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=8)


def _structures(model: Transformer) -> list[int | None]:
    return [forward_regions.structure_key(id(block)) for block in model.layers]


def test_identical_blocks_share_a_structure_and_a_changed_one_does_not(fake_world: None) -> None:
    model = shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard)
    first, second, third = _structures(model)
    assert first is not None and first == second == third
    # A plain attribute the forward reads (the head count) changes the structure.
    model.layers[2].attention.n_heads = 4
    # A hook the other blocks lack, and the training flag, do too.
    model.layers[1].feed_forward.register_forward_hook(lambda *args: None)
    keys = _structures(model)
    assert len(set(keys)) == 3 and keys[0] == first
    model.layers[0].eval()
    assert _structures(model)[0] != first
    # Another model of the same architecture: the same structure.
    other = shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard)
    assert _structures(other)[0] == first
    # Other parameter shapes: another structure.
    wide = shard_transformer(Transformer(dataclasses.replace(CONFIG, dim=32)),
                             fsdp_traceable.fully_shard)
    assert _structures(wide)[0] != first


def test_a_module_holding_another_fully_shard_module_has_no_region(fake_world: None) -> None:
    model = Transformer(CONFIG)
    fsdp_traceable.fully_shard(model.layers[0].feed_forward)
    shard_transformer(model, fsdp_traceable.fully_shard)
    assert forward_regions.structure_key(id(model.layers[0])) is None
    assert forward_regions.structure_key(id(model.layers[0].feed_forward)) is not None
    assert forward_regions.structure_key(id(model)) is None  # the root holds the blocks


def test_calls_key_by_argument_layout_and_value_and_pass_flat_tensors(fake_world: None) -> None:
    block = shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard).layers[0]
    unsharded = (torch.ones(4),)

    def key(*args: object, **kwargs: object) -> int | None:
        call = forward_regions.call_key(block, unsharded, args, kwargs)
        return None if call is None else call[0]

    x = torch.ones(2, 3)
    first = key(x, mask=None, scale=2.0)
    assert first == key(torch.zeros(2, 3), mask=None, scale=2.0)
    assert first != key(torch.ones(3, 2), mask=None, scale=2.0)
    assert first != key(torch.ones(3, 2).t(), mask=None, scale=2.0)
    assert first != key(x, mask=None, scale=3.0)
    assert first != key(x, mask=None, scale=2)  # equal values, another type
    assert key(x, cache=nn.Identity()) is None
    # The region gets one flat tuple, each distinct tensor once, and rebuilds the rest.
    y = torch.zeros(1)
    call = forward_regions.call_key(block, unsharded, (x, [x, 1]), {"y": y, "n": None})
    assert call is not None
    call_key, inputs = call
    assert len(inputs) == 3 and inputs[0] is unsharded[0] and inputs[1] is x and inputs[2] is y
    count, layout = forward_regions._recorded_call_layout(call_key)
    args, kwargs = forward_regions._rebuild(layout, inputs[count:], ())
    assert args[0] is x and args[1][0] is x and args[1][1] == 1 and type(args[1]) is list
    assert kwargs == {"y": y, "n": None} and kwargs["y"] is y
