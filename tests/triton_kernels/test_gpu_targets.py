"""The GPU target check: every CUDA variant of the copy kernels compiles for sm_80,
sm_90 and sm_100 without a GPU (no spills, at most 128 registers), and the check
fails when a kernel does not compile or exceeds the limits.

The main job compiles every variant for sm_90 and a pairwise covering for sm_80 and
sm_100 (all three in full run in the compatibility job: ``.ci/compat.sh``).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from fsdp_traceable.triton_kernels.fields import (  # noqa: E402
    KIND_BF16,
    KIND_BYTES,
    KIND_F32,
    KIND_OF_DTYPE_NAME,
    SCALE_DIVIDE,
    SCALE_NONE,
    SCALE_RECIPROCAL,
)
from fsdp_traceable.triton_kernels.launch_args import pack_launch  # noqa: E402
from fsdp_traceable.triton_kernels.loader import kernels_module, load_kernels  # noqa: E402
from tests.triton_kernels import cuda_variants as variants_module  # noqa: E402
from tests.triton_kernels import gpu_targets  # noqa: E402
from tests.triton_kernels.variant_sample import _pairs, choices, pairwise_sample  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def sm90_variants() -> list[variants_module.KernelVariant]:
    return variants_module.cuda_variants(kernels_module(False), 90)


def _constexpr(variant: variants_module.KernelVariant, name: str):
    return variant.constexprs[(list(variant.signature).index(name),)]


def test_variants_are_the_cuda_launches(sm90_variants):
    """Every destination kind with every CUDA pre-divide, GPU casts only; the CPU's
    divide and hand-made casts never reach a GPU variant."""
    pack = [v for v in sm90_variants if v.kernel == "pack_tiles"]
    assert {_constexpr(v, "MANUAL_CASTS") for v in pack} == {False}
    float_kinds = set(KIND_OF_DTYPE_NAME.values())
    assert {(_constexpr(v, "DST"), _constexpr(v, "SCALE_MODE")) for v in pack} == {
        *itertools.product(float_kinds, (SCALE_NONE, SCALE_RECIPROCAL)), (KIND_BYTES, SCALE_NONE)}
    assert SCALE_DIVIDE not in {_constexpr(v, "SCALE_MODE") for v in pack}
    unpack = [v for v in sm90_variants if v.kernel == "unpack_tiles"]
    assert {v.signature["in_ptr"] for v in unpack} == {"*u8", "*i16", "*i32", "*i64"}


def test_a_byte_copy_refuses_float_sources_and_a_predivide():
    tensors = (None,) * 4
    sizes = dict(scale=1.0, row_numel=16, tiles_per_row=1, num_tiles=1, world=1,
                 interpret=False, tile=2048)
    with pytest.raises(ValueError, match="byte copy"):
        pack_launch(*tensors, src_kinds={KIND_BYTES, KIND_F32}, dst_kind=KIND_BYTES,
                    scale_mode=SCALE_NONE, **sizes)
    with pytest.raises(ValueError, match="byte copy"):
        pack_launch(*tensors, src_kinds={KIND_BYTES}, dst_kind=KIND_BYTES,
                    scale_mode=SCALE_RECIPROCAL, **sizes)
    with pytest.raises(ValueError, match="float sources"):
        pack_launch(*tensors, src_kinds={KIND_BYTES}, dst_kind=KIND_BF16,
                    scale_mode=SCALE_NONE, **sizes)


def test_pairwise_sample_covers_every_pair(sm90_variants):
    sample = pairwise_sample(sm90_variants)
    assert len(sample) < len(sm90_variants) / 4
    for kernel in ("pack_tiles", "unpack_tiles"):
        def pairs(vs):
            return set().union(*(_pairs(choices(v)) for v in vs if v.kernel == kernel))
        assert pairs(sample) == pairs(sm90_variants)


@pytest.mark.slow
def test_cuda_variants_compile_within_limits():
    """A pairwise covering of the variants for sm_80, sm_90 and sm_100 (the
    compatibility job compiles every variant for all three on each Triton it installs);
    known excesses (``KNOWN_EXCESSES``) are printed."""
    report = gpu_targets.check(archs=(), sample_archs=(80, 90, 100))
    print(report.summary())
    assert not report.problems, report.summary()
    assert {r.arch for r in report.results} == {80, 90, 100}


def test_check_fails_on_a_gpu_only_branch_that_does_not_compile(tmp_path, sm90_variants):
    """A typo in the hardware-cast branch (``MANUAL_CASTS=False``), which the
    interpreter never traces, fails the check with the variant and the source line."""
    with open(kernels_module(False).__file__) as file:
        text = file.read()
    good = "y = x.to(tl.bfloat16).to(tl.float32)"
    assert good in text
    broken = tmp_path / "broken_kernels.py"
    broken.write_text(text.replace(good, "y = x.to(tl.bfloat17).to(tl.float32)"))
    module = load_kernels(str(broken), "triton_kernels._kernels_broken_for_test")
    bf16 = [v for v in variants_module.cuda_variants(module, 90)
            if v.kernel == "pack_tiles" and _constexpr(v, "DST") == KIND_BF16][:1]
    report = gpu_targets.check(archs=(90,), workers=1, kernels=module, variants=bf16,
                               known_excesses={})
    assert len(report.problems) == 1
    problem = report.problems[0]
    assert "compile error" in problem and "DST=1" in problem, problem
    assert "tl.bfloat17" in problem, problem  # the offending source line


def test_check_fails_on_spills_and_on_too_many_registers(sm90_variants):
    """A variant squeezed into 32 registers spills; a 16-register limit fails the rest."""
    variant = sm90_variants[0]
    squeezed = dataclasses.replace(variant, options={**variant.options, "maxnreg": 32})
    report = gpu_targets.check(archs=(90,), workers=2, max_registers=16,
                               variants=[variant, squeezed], known_excesses={})
    assert len(report.problems) == 2, report.summary()
    assert "registers per thread > 16" in report.problems[0]
    assert "spills" in report.problems[1]


def test_known_excesses_are_listed_not_failed_and_strict_fails_them():
    import triton

    prefix = triton.__version__[:4]
    results = [gpu_targets.CompileResult("pack_tiles(...)", "pack_tiles", 100, 96, 8),
               gpu_targets.CompileResult("unpack_tiles(...)", "unpack_tiles", 90, 200)]
    known = {(prefix, 100, "pack_tiles"): (128, 8), (prefix, 90, "unpack_tiles"): (136, 0)}
    report = gpu_targets.Report(results, 0.0, 128, known)
    assert len(report.problems) == 1 and "200 registers" in report.problems[0]
    assert len(report.known) == 1 and "accepts 128 registers, 8 bytes" in report.known[0]
    assert "KNOWN (1, not failing)" in report.summary()
    strict = gpu_targets.Report(results, 0.0, 128, {})
    assert len(strict.problems) == 2 and not strict.known
