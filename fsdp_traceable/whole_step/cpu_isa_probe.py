"""Inductor's probe of the host's CPU vector instruction sets, recorded where a step is
saved and trusted where the same host loads it.

[Note: the CPU vector ISA probe]
Before the first C++ kernel of a process loads (a saved step's CPU kernels included),
Inductor decides which vector ISAs the host runs (``cpu_vec_isa.valid_vec_isa_list``):
for each one the CPU advertises, it builds a test library and loads it in a child
Python process, about a second in all. A restarted process that loads a saved step
compiles nothing, so that probe is most of its first step on CPU. The saving process
ran the same probe: its outcome is written next to the saved step, and a loading
process whose CPU advertises exactly the same instruction sets, and for which the probe
had found every advertised set usable, takes that outcome instead of probing
(``config.cpp.vec_isa_ok`` while the list is first computed; the list is then kept for
the process, as the probe's is). Anything else (another CPU, a set the probe rejected,
``TORCHINDUCTOR_VEC_ISA_OK`` set, another architecture, a torch without these
functions) probes as usual.

``vec_isa_ok`` does not answer for the sets' extensions (AVX-512 BF16, AMX FP16, and
VNNI itself): Inductor still loads a test library for each in a child process. The
saved outcome records them too, and which of them the CPU has (torch checks an
extension only where ``torch.cpu`` reports it: one the CPU lacks, AMX FP16 on a CPU
with AMX BF16 only, is absent without any load). Where the saving process found every
extension its CPU has usable, a loading process whose CPU has the same ones answers
those load checks yes (``_torch_patches.isa_load_checks_answered``) and checks, once
the list is computed, that it found the same extensions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import platform
from typing import Any

import torch

from .. import _torch_patches

log = logging.getLogger(__name__)

# The extensions Inductor's ISA objects record, by attribute.
_EXTENSIONS = ("_is_avx512_bf16_supported", "_is_amx_fp16_supported")


def _probe_api() -> Any | None:
    """Inductor's ``cpu_vec_isa`` module where it has what this module reads, on x86."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    needed = ("valid_vec_isa_list", "supported_vec_isa_list", "x86_isa_checker")
    if not all(hasattr(cpu_vec_isa, name) for name in needed):
        return None
    if not hasattr(cpu_vec_isa.valid_vec_isa_list, "cache_info"):
        return None
    return cpu_vec_isa


def _advertised(cpu_vec_isa: Any) -> list[str]:
    """The ISAs whose every flag this CPU advertises (what the probe then tests)."""
    flags = cpu_vec_isa.x86_isa_checker()
    return [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def _cpu_extensions() -> dict[str, bool]:
    """Per extension, whether this CPU has it (``torch.cpu``'s query of the same name,
    which gates Inductor's check of it)."""
    return {name: bool(getattr(torch.cpu, name)()) for name in _EXTENSIONS
            if hasattr(torch.cpu, name)}


def _extensions(isas: list[Any]) -> dict[str, dict[str, bool]]:
    """Per ISA, the extensions the probe found it has (what its objects record)."""
    return {str(isa): {name: bool(getattr(isa, name)) for name in _EXTENSIONS
                       if hasattr(isa, name)} for isa in isas}


def save_probe(path: pathlib.Path) -> bool:
    """Writes this process's probe outcome to ``path`` if the probe ran here (not when
    ``config.cpp.vec_isa_ok`` answers for it: that list is no probe's outcome).

    Returns:
        Whether it was written.
    """
    cpu_vec_isa = _probe_api()
    if (cpu_vec_isa is None or torch._inductor.config.cpp.vec_isa_ok is not None
            or not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize):
        return False
    valid = cpu_vec_isa.valid_vec_isa_list()
    record = {"advertised": _advertised(cpu_vec_isa), "valid": [str(isa) for isa in valid],
              "extensions": _extensions(valid), "cpu_extensions": _cpu_extensions()}
    path.write_text(json.dumps(record))
    return True


def trust_saved_probe(path: pathlib.Path) -> bool:
    """Takes the saved probe outcome at ``path`` for this process where it applies (see
    [Note: the CPU vector ISA probe]).

    Returns:
        Whether this process's ISA list now comes from the saved outcome.
    """
    cpu_vec_isa = _probe_api()
    if (cpu_vec_isa is None or not path.is_file()
            or torch._inductor.config.cpp.vec_isa_ok is not None
            or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize):
        return False
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    advertised = _advertised(cpu_vec_isa)
    if record.get("advertised") != advertised or record.get("valid") != advertised:
        return False
    extensions, cpu_has = record.get("extensions"), _cpu_extensions()
    all_usable = (isinstance(extensions, dict) and record.get("cpu_extensions") == cpu_has
                  and all(usable or not cpu_has.get(name, True)
                          for found in extensions.values() for name, usable in found.items()))
    with (torch._inductor.config.patch({"cpp.vec_isa_ok": True}),
          _torch_patches.isa_load_checks_answered() if all_usable else contextlib.nullcontext()):
        isas = cpu_vec_isa.valid_vec_isa_list()
    trusted = [str(isa) for isa in isas]
    if all_usable and _extensions(isas) != extensions:
        log.warning("CPU vector ISA extensions %s differ from the saved %s (%s)",
                    _extensions(isas), extensions, path)
    log.debug("CPU vector ISAs %s taken from %s, not probed", trusted, path)
    return trusted == advertised
