"""The patch of ``fsdp_traceable/_torch_patches/traced_backward.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_traceable import _torch_patches
from fsdp_traceable.introspection.fake_world import fake_process_group

# -- Dynamo traces backward() into DTensor parameters (torch 2.11) --------------------

needs_subclass_patch = pytest.mark.skipif(
    not _torch_patches.subclass_patch_needed(),
    reason="this torch's Dynamo traces backward() into tensor subclasses itself, or not at all")


def _dtensor_step_grad(monkeypatch, patched: bool) -> torch.Tensor:
    """``(w * x).sum().backward()`` compiled over a DTensor parameter ``w``: its gradient."""
    from torch._dynamo.variables import torch as torch_variables

    assert _torch_patches.trace_backward_into_subclasses()
    if not patched:
        wrapper = torch_variables._collect_tensors_with_sources
        monkeypatch.setattr(torch_variables, "_collect_tensors_with_sources", wrapper.__wrapped__)
    with fake_process_group(1), torch._dynamo.config.patch(trace_autograd_ops=True):
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)]))
        x = DTensor.from_local(torch.full((4,), 3.0), mesh, [Shard(0)])

        def step(x: DTensor) -> None:
            (weight * x).sum().backward()

        torch._dynamo.reset()
        torch.compile(step, backend="aot_eager", fullgraph=True)(x)
        return weight.grad


@needs_subclass_patch
def test_torch_still_asserts_on_dtensor_leaves_in_backward(monkeypatch) -> None:
    with pytest.raises(Exception) as raised:  # Dynamo's bare assert on the DTensor
        _dtensor_step_grad(monkeypatch, patched=False)
    error = raised.value
    assert isinstance(error, AssertionError) or isinstance(error.__cause__, AssertionError)


@needs_subclass_patch
def test_backward_traced_into_dtensor_parameters(monkeypatch) -> None:
    grad = _dtensor_step_grad(monkeypatch, patched=True)
    assert isinstance(grad, DTensor) and torch.equal(grad.to_local(), torch.full((4,), 3.0))
