"""fully_shard's eager mode: what forward keeps alive, peak memory against FSDP2, and
the order of collectives and compute (prefetching), on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

import fsdp_traceable.fsdp.gradient_reduction as gradient_reduction_module
import fsdp_traceable.fsdp.group_all_gather as group_all_gather_module
from fsdp_traceable.cli.memory import peak_allocated_bytes
from fsdp_traceable.fsdp.saved_unsharded import SavedUnsharded
from fsdp_traceable.models.transformer import TransformerConfig
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases
from tests.fsdp.parity_utils import batch, make_models

pytestmark = pytest.mark.gloo

CONFIG = TransformerConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, max_seq_len=16)
MEMORY_CONFIG = TransformerConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, max_seq_len=64)


def _unsharded_bytes_saved(reshard_after_forward: bool, compile_blocks: bool = False) -> int:
    """Bytes of block parameters' unsharded storage that autograd saves for backward
    (with ``compile_blocks``, each block's compute compiled by ``block.compile()``:
    what its compiled forward saves goes through the same hooks).

    Every save is observed: inside FSDP modules by wrapping the pack hook that
    fully_shard installs (it swaps unsharded parameters for tokens), elsewhere by an
    outer ``saved_tensors_hooks``. A save counts if its storage is the storage of an
    unsharded block parameter and it was saved as a tensor, not a token.
    """
    _, _, model = make_models(CONFIG, reshard_after_forward=reshard_after_forward)
    if compile_blocks:
        for layer in model.layers:
            layer.compile(backend="aot_eager", fullgraph=True)
    block_infos = {id(layer._fsdp_group.params.infos[0]) for layer in model.layers}
    # Holding the tensors keeps their addresses from being reused by activations.
    unsharded_storages: dict[int, torch.Tensor] = {}
    saved_bytes = 0
    original_copy_out = group_all_gather_module.foreach_all_gather_copy_out
    original_pack = SavedUnsharded._pack

    def recording_copy_out(result):
        outputs = original_copy_out(result)
        if id(result.infos[0]) in block_infos:
            unsharded_storages.update((t.untyped_storage().data_ptr(), t) for t in outputs)
        return outputs

    def record(tensor: torch.Tensor, packed: object) -> object:
        nonlocal saved_bytes
        if packed is tensor and tensor.untyped_storage().data_ptr() in unsharded_storages:
            saved_bytes += tensor.untyped_storage().nbytes()
        return packed

    group_all_gather_module.foreach_all_gather_copy_out = recording_copy_out
    SavedUnsharded._pack = lambda self, t: record(t, original_pack(self, t))
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: record(t, t), lambda t: t):
            loss = model.loss(*batch(0, torch.distributed.get_rank(), 2, CONFIG))
        loss.backward()  # backward still works: it re-gathers what forward did not keep
    finally:
        group_all_gather_module.foreach_all_gather_copy_out = original_copy_out
        SavedUnsharded._pack = original_pack
    return saved_bytes


def _memory_body(rank: int, world_size: int) -> dict[str, object]:
    # The benchmark's shape of workload (batch 8 x 64 tokens): activations matter, as in
    # real training. In a model this small with a tiny batch the parameters dominate,
    # and the forward prefetch (which FSDP2 does not do on CPU) costs up to one group.
    _, theirs, ours = make_models(MEMORY_CONFIG)
    generator = torch.Generator().manual_seed(rank)
    data = tuple(torch.randint(0, MEMORY_CONFIG.vocab_size, (8, MEMORY_CONFIG.max_seq_len),
                               generator=generator) for _ in range(2))
    for model in (theirs, ours):  # warm up lazy init and caches
        model.loss(*data).backward()
        model.zero_grad(set_to_none=True)
    peaks: dict[str, list[int]] = {"fsdp2": [], "ours": []}
    for _ in range(5):
        for name, model in (("fsdp2", theirs), ("ours", ours)):
            peaks[name].append(peak_allocated_bytes(
                lambda: model.loss(*data).backward(), caller_thread_only=True))
            model.zero_grad(set_to_none=True)
    return {
        "resharded": _unsharded_bytes_saved(True),
        "resharded_blocks_compiled": _unsharded_bytes_saved(True, compile_blocks=True),
        "kept": _unsharded_bytes_saved(False),
        "peaks": peaks,
    }


def test_forward_saves_no_unsharded_params_and_peak_not_above_fsdp2() -> None:
    for result in run_on_local_ranks(_memory_body, 2):
        assert result["resharded"] == 0
        assert result["resharded_blocks_compiled"] == 0
        # The control: without resharding, autograd saves (views of) every block weight.
        assert result["kept"] >= 4 * CONFIG.n_layers * CONFIG.dim * CONFIG.dim * 4
        # Allocator traffic between steps varies by a buffer now and then: compare each
        # library's least disturbed step.
        peaks = result["peaks"]
        assert min(peaks["ours"]) <= min(peaks["fsdp2"]), peaks


def _order_body(rank: int, world_size: int) -> list[tuple[str, str]]:
    _, _, model = make_models(CONFIG)
    # Keyed by a group's first ShardInfo object, which every bucket of the group starts with.
    names = {id(model._fsdp_group.params.infos[0]): "root"}
    names.update({id(layer._fsdp_group.params.infos[0]): f"block{i}" for i, layer in enumerate(model.layers)})
    events: list[tuple[str, str]] = []
    original_gather = group_all_gather_module.foreach_all_gather
    original_reduce = gradient_reduction_module.start_foreach_reduce

    def gather(tensors, infos, *args, **kwargs):
        events.append(("all_gather", names[id(infos[0])]))
        return original_gather(tensors, infos, *args, **kwargs)

    def reduce(grads, infos, *args, **kwargs):
        events.append(("reduce_scatter", names[id(infos[0])]))
        return original_reduce(grads, infos, *args, **kwargs)

    for i, layer in enumerate(model.layers):
        layer.attention_norm.register_forward_pre_hook(
            lambda *_, i=i: events.append(("forward_compute", f"block{i}")))
        layer.attention_norm.register_full_backward_pre_hook(
            lambda *_, i=i: events.append(("backward_compute_end", f"block{i}")))
    group_all_gather_module.foreach_all_gather = gather
    gradient_reduction_module.start_foreach_reduce = reduce
    try:
        for step in range(2):
            events.clear()
            model.loss(*batch(step, rank, world_size, CONFIG)).backward()
    finally:
        group_all_gather_module.foreach_all_gather = original_gather
        gradient_reduction_module.start_foreach_reduce = original_reduce
    return events


def test_next_group_all_gather_issued_before_current_compute() -> None:
    n = CONFIG.n_layers
    for events in run_on_local_ranks(_order_body, 2):
        position = {event: index for index, event in reversed(list(enumerate(events)))}
        gathers = [e for e in events if e[0] == "all_gather"]
        # Forward: root, then every block once; backward: every block again (re-gather),
        # the root kept its parameters.
        assert gathers == [("all_gather", "root")] + [
            ("all_gather", f"block{i}") for i in range(n)
        ] + [("all_gather", f"block{i}") for i in reversed(range(n))]
        for i in range(n - 1):
            next_gather = min(j for j, e in enumerate(events) if e == ("all_gather", f"block{i + 1}"))
            assert next_gather < position[("forward_compute", f"block{i}")]
        # Backward: block i-1's re-gather is issued before block i's backward is done
        # and before block i's reduce-scatter.
        backward_gathers = [j for j, e in enumerate(events) if e[0] == "all_gather"][n + 1:]
        for i in range(n - 1, 0, -1):
            regather = [j for j in backward_gathers if events[j] == ("all_gather", f"block{i - 1}")][0]
            assert regather < position[("backward_compute_end", f"block{i}")]
            assert regather < position[("reduce_scatter", f"block{i}")]
        assert [e for e in events if e[0] == "reduce_scatter"] == [
            ("reduce_scatter", f"block{i}") for i in reversed(range(n))
        ] + [("reduce_scatter", "root")]


def test_one_rank_mesh_matches_fsdp2_bitwise_without_collectives() -> None:
    [result] = run_on_local_ranks(run_cases, 1, [("single", parity_cases.single_rank, ())])
    result = result["single"]
    assert "error" not in result, result.get("error")
    theirs, ours = result["theirs"], result["ours"]
    assert ours["losses"] == theirs["losses"]
    assert_bitwise(theirs["grads"], ours["grads"], "first-step gradients")
    assert_bitwise(theirs["params"], ours["params"], "parameters")
    # Neither library all-gathers over one rank; both copy the shard.
    assert theirs["all_gather_group_sizes"] == ours["all_gather_group_sizes"] == []
