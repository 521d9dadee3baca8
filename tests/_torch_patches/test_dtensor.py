"""The patches of ``fsdp_traceable/_torch_patches/dtensor.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable.introspection.capture import InductorCapture
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
from fsdp_traceable.testing import count_collectives

compiled_autograd = torch._dynamo.compiled_autograd


# -- Dynamo skips DTensor.__tensor_unflatten__ as a frame of its own ----------------

@pytest.fixture
def dtensor_parts() -> Iterator[tuple[dict[str, torch.Tensor], object, torch.Size, tuple]]:
    """The arguments AOTAutograd's runtime passes ``DTensor.__tensor_unflatten__``."""
    with fake_process_group(1):
        mesh = init_device_mesh("cpu", (1,))
        dtensor = DTensor.from_local(torch.randn(4, 4), mesh, [Shard(0)], run_check=False)
        names, spec = dtensor.__tensor_flatten__()
        yield {name: getattr(dtensor, name) for name in names}, spec, dtensor.size(), dtensor.stride()


def test_torch_still_cannot_trace_dtensor_unflatten(dtensor_parts) -> None:
    inner, spec, size, stride = dtensor_parts

    def unflatten(inner: dict[str, torch.Tensor]) -> DTensor:
        return DTensor.__tensor_unflatten__(inner, spec, size, stride)

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(unflatten, backend="eager", fullgraph=True)(inner)


def test_dtensor_unflatten_frame_runs_eagerly_without_a_graph_break(dtensor_parts) -> None:
    assert _torch_patches.skip_dtensor_unflatten_frames()
    assert _torch_patches.skip_dtensor_unflatten_frames()  # again: no change
    inner, spec, size, stride = dtensor_parts
    counters.clear()
    out = torch.compile(DTensor.__tensor_unflatten__, backend="eager")(inner, spec, size, stride)
    assert isinstance(out, DTensor)
    assert not counters["graph_break"]


# -- DTensor's new_empty_strided keeps an uneven Shard(0) ---------------------------

def _dim0_piece(mesh: DeviceMesh, rows: int, global_rows: int, cols: int) -> DTensor:
    """Rank 0's ``[rows, cols]`` piece of a ``[global_rows, cols]`` tensor sharded on dim 0."""
    return DTensor.from_local(torch.randn(rows, cols), mesh, [Shard(0)], run_check=False,
                              shape=torch.Size((global_rows, cols)), stride=(cols, 1))


@pytest.fixture
def uneven_mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh of 4 fake ranks: 29 rows shard as 8, 8, 8, 5."""
    with fake_process_group(4):
        yield init_device_mesh("cpu", (4,))


def _new_empty_strided(dtensor: DTensor) -> DTensor:
    return dtensor.new_empty_strided(dtensor.size(), dtensor.stride())


def test_torch_still_replicates_an_uneven_new_empty_strided(uneven_mesh) -> None:
    if not _torch_patches.shard_uneven_new_empty_strided():
        pytest.skip("this torch keeps an uneven shard's placement on its own (no patch "
                    "applied; the next test shows the placement)")
    # Another shape than the next test's (DTensor caches the result per op and shapes).
    piece = _dim0_piece(uneven_mesh, 8, 30, 7)
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.new_empty_strided.default
    patched = propagator.op_strategy_funcs[op]
    propagator.op_strategy_funcs[op] = patched.__wrapped__
    propagator.propagate_op_sharding.cache_clear()
    try:
        assert _new_empty_strided(piece).placements == (Replicate(),)
    finally:
        propagator.op_strategy_funcs[op] = patched
        propagator.propagate_op_sharding.cache_clear()


def test_compiled_autograd_keeps_uneven_gradients_sharded(uneven_mesh) -> None:
    # new_empty_strided itself, then a compiled-autograd backward (what calls it): the
    # gradients stay Shard(0) with the parameters' local shapes, and the backward
    # all-gathers only the resharded block's bucket, no parameter on its own.
    empty = _new_empty_strided(_dim0_piece(uneven_mesh, 8, 29, 29))
    assert empty.placements == (Shard(0),) and empty.to_local().shape == (8, 29)

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=29, n_layers=1, n_heads=1, hidden_dim=37,
                               max_seq_len=8)
    model = shard_transformer(Transformer(config), fsdp_traceable.fully_shard)
    tokens = torch.randint(0, 40, (2, 8))
    loss = torch.compile(model.loss, backend="aot_eager", fullgraph=True)(tokens, tokens)
    capture = InductorCapture(inductor=False)
    with compiled_autograd._enable(torch.compile(backend=capture.backend, fullgraph=True)):
        loss.backward()
    # Compiled autograd's graph runs without grad: AOTAutograd's inference graph.
    assert count_collectives(capture.graph_modules["aot_inference"])["all_gather"] == 1
    for name, param in model.named_parameters():
        assert param.grad.placements == (Shard(0),), name
        assert param.grad.to_local().shape == param.to_local().shape, name
