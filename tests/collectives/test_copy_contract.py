"""Every copy backend implements the copy-op contract, ``CopyOps``, with its signatures."""

from __future__ import annotations

import inspect

import pytest

from fsdp_traceable.collectives import copy_backends, foreach_copies
from fsdp_traceable.collectives.copy_contract import COPY_OPS, CopyOps


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_copy_ops_lists_the_protocol_methods() -> None:
    methods = [name for name, value in vars(CopyOps).items()
               if callable(value) and not name.startswith("_")]
    assert tuple(methods) == COPY_OPS


@pytest.mark.parametrize("implementation", [
    *copy_backends.COPY_BACKENDS.values(), foreach_copies, copy_backends,
], ids=[*copy_backends.COPY_BACKENDS, "foreach_copies", "copy_backends"])
@pytest.mark.parametrize("op", COPY_OPS)
def test_backend_has_the_contract_signature(implementation, op: str) -> None:
    assert _parameters(getattr(implementation, op)) == _parameters(getattr(CopyOps, op))
