"""The patch of ``fsdp_traceable/_torch_patches/precompiled_header.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import inspect

import pytest

from fsdp_traceable import _torch_patches

# -- Inductor precompiles the C++ kernels' header before finding their libraries ------

needs_header_precompile = pytest.mark.skipif(
    not _torch_patches.skip_header_precompile_on_load(),
    reason="this torch precompiles no header, or keys a library by the header's path")


@needs_header_precompile
def test_torch_still_precompiles_the_header_before_finding_a_library() -> None:
    from torch._inductor import codecache

    source = inspect.getsource(codecache.CppPythonBindingsCodeCache.load_async)
    lookup = source.find("if key not in cls.cache")
    assert 0 <= lookup < source.find("_precompile_header(")


class _HeaderPrecompiled(Exception):
    pass


@needs_header_precompile
def test_header_precompile_skipped_inside_the_context_only(monkeypatch) -> None:
    from torch._inductor import codecache

    def precompiling(**options):
        raise _HeaderPrecompiled

    monkeypatch.setattr(codecache, "CppTorchDeviceOptions", precompiling)
    with _torch_patches.header_precompile_skipped() as skipped:
        assert skipped
        assert codecache._precompile_header("cpp_prefix.h", "no command line") is None
    with pytest.raises(_HeaderPrecompiled):  # torch's own runs again
        codecache._precompile_header("cpp_prefix.h", "no command line")
