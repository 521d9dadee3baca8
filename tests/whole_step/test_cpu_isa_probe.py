"""The host's CPU vector ISA probe, recorded by a saving process and taken by a loading
one (``fsdp_traceable/whole_step/cpu_isa_probe.py``), against Inductor's own probe."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from fsdp_traceable import _torch_patches
from fsdp_traceable.whole_step import cpu_isa_probe

cpu_vec_isa = cpu_isa_probe._probe_api()
pytestmark = pytest.mark.skipif(cpu_vec_isa is None, reason="Inductor probes vector ISAs on x86 only")


@pytest.fixture
def probed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple[pathlib.Path, list[str]]:
    """The process's ISA list saved as a saving process saves its probe outcome; then the
    list forgotten and Inductor left to probe, with any probe failing the test. The list
    is restored after it. (The suite sets ``TORCHINDUCTOR_VEC_ISA_OK``, which answers for
    the probe: nothing is saved then. It is lifted here, the list the suite computed
    standing for a probe's.)"""
    valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    path = tmp_path / "step.isa.json"
    with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
        assert not cpu_isa_probe.save_probe(path) and not path.exists()

    def probe(self: object, code: str) -> bool:
        raise AssertionError("the host's vector ISAs were probed")

    with torch._inductor.config.patch({"cpp.vec_isa_ok": None}):
        assert cpu_isa_probe.save_probe(path)
        assert json.loads(path.read_text())["valid"] == valid
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", probe)
        yield path, valid
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == valid


def test_a_loading_process_takes_the_saved_outcome_instead_of_probing(probed) -> None:
    path, valid = probed
    if valid != cpu_isa_probe._advertised(cpu_vec_isa):
        pytest.skip("the probe rejected an instruction set this CPU advertises")
    assert cpu_isa_probe.trust_saved_probe(path)
    assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == valid


def test_another_cpu_or_a_rejected_set_is_probed_again(probed) -> None:
    path, valid = probed
    record = json.loads(path.read_text())
    for changed in ({**record, "advertised": record["advertised"] + ["avx1024"]},
                    {**record, "valid": record["valid"][1:]}):
        path.write_text(json.dumps(changed))
        assert not cpu_isa_probe.trust_saved_probe(path)
        assert not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
    assert not cpu_isa_probe.trust_saved_probe(path.with_name("missing.json"))


def _saved_probe(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """This process's probe (every load succeeding) saved, as a saving process does."""
    valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    if valid != cpu_isa_probe._advertised(cpu_vec_isa):
        pytest.skip("the probe rejected an instruction set this CPU advertises")
    path = tmp_path / "step.isa.json"
    assert cpu_isa_probe.save_probe(path)
    record = json.loads(path.read_text())
    assert record["extensions"] == cpu_isa_probe._extensions(cpu_vec_isa.valid_vec_isa_list())
    return path, record


_answers_loads = pytest.mark.skipif(
    not _torch_patches.answer_isa_load_checks(),
    reason="this torch loads no ISA test library in a child process each time")


@_answers_loads
def test_extensions_found_usable_are_not_loaded_again(
        tmp_path: pathlib.Path, forgotten_cpu_isa_probe) -> None:
    loads, forget = forgotten_cpu_isa_probe
    path, record = _saved_probe(tmp_path)
    if not any(record["extensions"].values()):
        pytest.skip("no ISA extension to check on this CPU")
    # A new process on the same host: no load at all, the same extensions.
    forget()
    probed = len(loads)
    assert cpu_isa_probe.trust_saved_probe(path) and len(loads) == probed
    assert cpu_isa_probe._extensions(cpu_vec_isa.valid_vec_isa_list()) == record["extensions"]
    # An extension the saving process could not use, or a saving CPU with other
    # extensions: every extension is loaded again.
    unusable = {isa: dict.fromkeys(found, False) for isa, found in record["extensions"].items()}
    other_cpu = {name: not has for name, has in record["cpu_extensions"].items()}
    for changed in ({**record, "extensions": unusable}, {**record, "cpu_extensions": other_cpu}):
        path.write_text(json.dumps(changed))
        forget()
        probed = len(loads)
        assert cpu_isa_probe.trust_saved_probe(path) and len(loads) > probed


@_answers_loads
def test_an_extension_the_cpu_lacks_is_no_failed_load(
        tmp_path: pathlib.Path, forgotten_cpu_isa_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    # AVX-512 BF16 as on a CPU without it (as AMX FP16 on a CPU with AMX BF16 only):
    # Inductor does not check it, the probe records it absent, and a loading process
    # still loads nothing.
    loads, forget = forgotten_cpu_isa_probe
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    path, record = _saved_probe(tmp_path)
    if "avx512" not in record["valid"]:
        pytest.skip("no AVX-512 on this CPU")
    assert record["cpu_extensions"]["_is_avx512_bf16_supported"] is False
    assert not any(found.get("_is_avx512_bf16_supported", False)
                   for found in record["extensions"].values())
    forget()
    probed = len(loads)
    assert cpu_isa_probe.trust_saved_probe(path) and len(loads) == probed
    assert cpu_isa_probe._extensions(cpu_vec_isa.valid_vec_isa_list()) == record["extensions"]
