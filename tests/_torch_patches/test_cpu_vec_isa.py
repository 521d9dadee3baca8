"""The patch of ``fsdp_traceable/_torch_patches/cpu_vec_isa.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fsdp_traceable import _torch_patches

# -- Inductor loads each ISA extension's test library in a child process -------------

def _advertises_avx512() -> bool:
    from fsdp_traceable.whole_step import cpu_isa_probe

    cpu_vec_isa = cpu_isa_probe._probe_api()
    return cpu_vec_isa is not None and any(
        "avx512" in isa for isa in cpu_isa_probe._advertised(cpu_vec_isa))


needs_isa_load_checks = pytest.mark.skipif(
    not (_torch_patches.answer_isa_load_checks() and _advertises_avx512()),
    reason="this torch loads no ISA test library in a child process each time (2.14 keeps "
           "the outcome on disk), or no AVX-512 here")


def _isa_list_loads(loads: list[list[str]], answered: bool) -> int:
    """The child-process loads computing the ISA list with ``vec_isa_ok`` set takes."""
    from torch._inductor import cpu_vec_isa

    with (torch._inductor.config.patch({"cpp.vec_isa_ok": True}),
          _torch_patches.isa_load_checks_answered() if answered else contextlib.nullcontext()):
        assert cpu_vec_isa.valid_vec_isa_list()
    return len(loads)


@needs_isa_load_checks
def test_torch_still_loads_isa_extensions_in_child_processes(forgotten_cpu_isa_probe) -> None:
    loads, _ = forgotten_cpu_isa_probe
    assert _isa_list_loads(loads, answered=False) >= 1  # 3 on an AVX-512 BF16 + VNNI host


@needs_isa_load_checks
def test_isa_load_checks_answered_inside_the_context_only(forgotten_cpu_isa_probe) -> None:
    loads, forget = forgotten_cpu_isa_probe
    assert _isa_list_loads(loads, answered=True) == 0
    forget()
    assert _isa_list_loads(loads, answered=False) >= 1
