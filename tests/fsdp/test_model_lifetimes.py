"""Several sharded models in one process (train and eval copies, notebooks, test suites):
building, training and deleting models leaves nothing behind, and two live models never
reach each other's state. One real gloo rank, in this process."""

from __future__ import annotations

import gc
import importlib
import tracemalloc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp_traceable
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer

CONFIG = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)


def _module(name: str):
    return importlib.import_module(f"fsdp_traceable.{name}")


# Every process-wide container the library keeps (see [Note: per-model state]); each
# must be back to its size once the models are gone.
_REGISTRIES: dict[str, Callable[[], int]] = {
    "block_backward._shard_group_names": lambda: len(
        _module("fsdp.block_backward")._shard_group_names),
    "install._predicates": lambda: len(_module("backward_regions.install")._predicates),
    "install._outlined": lambda: len(_module("backward_regions.install")._outlined),
    "fully_shard._replaced_params": lambda: len(_module("fsdp.fully_shard")._replaced_params),
    "class_swap._fsdp_classes": lambda: len(_module("fsdp.class_swap")._fsdp_classes),
    "unsharded_binding._owner_classes": lambda: len(
        _module("fsdp.unsharded_binding")._owner_classes),
    # torch's, where each fully_shard-ed module's state is also entered
    "torch _composable_state._module_state_mapping": lambda: len(
        importlib.import_module("torch.distributed._composable_state")._module_state_mapping),
}


def _registry_sizes() -> dict[str, int]:
    return {name: size() for name, size in _REGISTRIES.items()}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return tuple(torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=generator)
                 for _ in range(2))


def _sharded(seed: int, mesh: DeviceMesh | None = None) -> Transformer:
    torch.manual_seed(seed)
    return shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard, mesh=mesh)


def _weakrefs(model: Transformer) -> list[weakref.ref]:
    refs = [weakref.ref(model), *(weakref.ref(layer) for layer in model.layers)]
    groups = {id(m._fsdp_group): m._fsdp_group for m in model.modules()
              if isinstance(m, fsdp_traceable.FSDPModule)}
    return refs + [weakref.ref(group) for group in groups.values()]


def _train(model: Transformer, steps: int = 2, loss_fn: Callable | None = None,
           backward: Callable[[], object] | None = None) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = loss_fn or model.loss
    losses = []
    for step in range(steps):
        loss = loss_fn(*_batch(step))
        if backward is None:
            loss.backward()
        else:
            with backward():
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


class _BackwardFailure(Exception):
    pass


def _fail(grad: torch.Tensor) -> torch.Tensor:
    raise _BackwardFailure


def _train_then_fail_in_backward(model: Transformer) -> None:
    """A step whose backward raises after the blocks' reductions started (the gradient
    of the first block's input raises), as an out-of-memory error would."""
    _train(model, steps=1)

    def fail_at_input_gradient(module: torch.nn.Module, args: tuple) -> None:
        args[0].register_hook(_fail)

    handle = model.layers[0].register_forward_pre_hook(fail_at_input_gradient)
    with pytest.raises(_BackwardFailure):
        model.loss(*_batch(1)).backward()
    handle.remove()


def _compiled_autograd() -> object:
    compiler = torch.compile(backend="aot_eager", fullgraph=True)
    return torch._dynamo.compiled_autograd._enable(compiler)


def _train_per_block_compiled(model: Transformer) -> None:
    """Per-block compile under compiled autograd (the traced paths and the outlined
    block backward), on the aot_eager backend."""
    for layer in model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    _train(model, backward=_compiled_autograd)
    outlined = _module("backward_regions.install")._outlined
    assert any(graph is not None for graph in outlined.values()), "no block backward outlined"


def _compiles() -> tuple[int, int]:
    """Graphs Dynamo compiled, and compiled autograd's captures, so far."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], counters["compiled_autograd"]["captures"]


def _build_train_delete(make: Callable[[], Transformer],
                        run: Callable[[Transformer], object]) -> list[weakref.ref]:
    model = make()
    run(model)
    refs = _weakrefs(model)
    del model
    gc.collect()
    return refs


_LIFETIMES: dict[str, tuple[Callable[[], Transformer], Callable[[Transformer], object]]] = {
    "eager": (lambda: _sharded(0), _train),
    "backward_raised": (lambda: _sharded(1), _train_then_fail_in_backward),
    "per_block_compiled": (lambda: _sharded(2), _train_per_block_compiled),
}


@pytest.fixture
def gloo_rank(one_gloo_rank: None) -> Iterator[None]:
    yield
    gc.collect()


@pytest.mark.slow  # the first per-block compile: seconds to a minute
def test_deleted_models_leave_nothing_behind(gloo_rank: None) -> None:
    growth: list[tuple[int, int]] = []
    for iteration in range(4):
        if iteration == 1:
            # After a warm-up: lazy imports, Dynamo's and torch's caches, and the
            # process-wide entries keyed by class (one FSDP class per module class).
            gc.collect()
            before = _registry_sizes()
            compiles = _compiles()
            tracemalloc.start()
            start = (tracemalloc.get_traced_memory()[0], len(gc.get_objects()))
        for name, (make, run) in _LIFETIMES.items():
            refs = _build_train_delete(make, run)
            alive = [type(ref()).__name__ for ref in refs if ref() is not None]
            assert not alive, f"{name}, iteration {iteration}: still alive: {alive}"
            if iteration >= 1:
                assert _registry_sizes() == before, f"{name}, iteration {iteration}"
        if iteration >= 1:
            gc.collect()
            growth.append((tracemalloc.get_traced_memory()[0] - start[0],
                           len(gc.get_objects()) - start[1]))
    tracemalloc.stop()
    # A new model of the same architecture reuses the compiled code: no guard fails.
    assert _compiles() == compiles
    # Iterations 2 and 3 each cost what iteration 1 did (Dynamo's cache entries, and
    # fresh ids in torch's own counters): no more per iteration than a bounded slack.
    per_iteration = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(growth, growth[1:])]
    assert all(bytes_ < 64_000 and objects < 200 for bytes_, objects in per_iteration), (
        f"growth per iteration after the warm-up (bytes, objects): {per_iteration}")


def test_models_on_their_own_process_groups_leave_nothing_behind(gloo_rank: None) -> None:
    """Each model on a mesh over a new process group (as a new 2-D mesh gets on
    several ranks)."""
    for iteration in range(3):
        mesh = DeviceMesh.from_group(dist.new_group([0]), "cpu")
        refs = _build_train_delete(lambda: _sharded(iteration, mesh), _train)
        assert all(ref() is None for ref in refs)
        if iteration == 0:  # after a warm-up (see above)
            before = _registry_sizes()
        assert _registry_sizes() == before, f"iteration {iteration}"


def _params(model: Transformer) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _assert_bitwise(actual: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), f"{what} {i} differs by {(a - e).abs().max().item()}"


def test_two_live_models_interleaved_match_their_own_runs(gloo_rank: None) -> None:
    """Model A's forward, model B's forward and backward, then A's backward: each
    matches a run of that model alone, bit for bit (A reshards its blocks after
    forward, so its backward re-gathers from the tokens its forward saved)."""
    steps = 2
    expected = {}
    for seed in (0, 1):
        model = _sharded(seed)
        expected[seed] = (_train(model, steps), _params(model))
        del model
    a, b = _sharded(0), _sharded(1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    losses: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in range(steps):
        loss_a = a.loss(*_batch(step))
        loss_b = b.loss(*_batch(step))
        loss_b.backward()
        opt_b.step()
        opt_b.zero_grad()
        loss_a.backward()
        opt_a.step()
        opt_a.zero_grad()
        losses[0].append(loss_a.detach())
        losses[1].append(loss_b.detach())
    for seed, model in ((0, a), (1, b)):
        _assert_bitwise(losses[seed], expected[seed][0], f"model {seed} loss")
        _assert_bitwise(_params(model), expected[seed][1], f"model {seed} parameter")


def test_a_backward_that_raised_leaves_its_reductions_to_its_own_model(gloo_rank: None) -> None:
    """Model A's backward raises with a reduction in flight; model B's whole step then
    writes no gradient of A's, and A's next backward finishes it."""
    a, b = _sharded(0), _sharded(1)
    _train_then_fail_in_backward(a)
    a.zero_grad(set_to_none=True)
    _train(b, steps=1)
    assert all(p.grad is None for p in a.parameters())
    a.loss(*_batch(2)).backward()
    assert all(p.grad is not None for p in a.parameters())


def test_one_backward_through_two_models_matches_their_own_runs(gloo_rank: None) -> None:
    """One loss over two models (both trained): each model's gradients are its own."""
    expected = {}
    for seed in (0, 1):
        model = _sharded(seed)
        expected[seed] = _train(model, steps=1) and _params(model)
        del model
    a, b = _sharded(0), _sharded(1)
    optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    (a.loss(*_batch(0)) + b.loss(*_batch(0))).backward()
    optimizer.step()
    for seed, model in ((0, a), (1, b)):
        _assert_bitwise(_params(model), expected[seed], f"model {seed} parameter")
    assert dist.get_world_size() == 1
