"""Compiles every CUDA variant of the copy kernels for GPU targets, without a GPU.

The Triton interpreter never traces the GPU-only branches (``MANUAL_CASTS=False``,
``SCALE_RECIPROCAL``); this check builds PTX and cubin for each variant of
:func:`tests.triton_kernels.cuda_variants.cuda_variants` with the wheel's bundled ``ptxas``
(no driver, no device, no torch) and fails on a compile error, a register spill, or
more than :data:`MAX_REGISTERS` registers per thread.

    python -m tests.triton_kernels.gpu_targets                # sm_80, sm_90, sm_100
    python -m tests.triton_kernels.gpu_targets --arch 90 --sample-arch 80 100

``--sample-arch`` compiles only a pairwise covering of the variants
(:func:`tests.triton_kernels.variant_sample.pairwise_sample`) for those archs. Excesses
measured before and listed in :data:`KNOWN_EXCESSES` are reported, not failed, up to
their measured size; ``--strict`` fails them too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import triton
from triton.backends.compiler import GPUTarget

from fsdp_traceable.triton_kernels.launch_args import NUM_WARPS, PROGRAMS_PER_SM
from fsdp_traceable.triton_kernels.loader import load_kernels
from tests.triton_kernels.cuda_variants import KernelVariant, cuda_variants
from tests.triton_kernels.variant_sample import pairwise_sample

ARCHS = (80, 90, 100)
REGISTERS_PER_SM = 65536  # sm_80 to sm_100
# Above this, fewer than PROGRAMS_PER_SM programs of the persistent grid fit an SM at
# once, and the last ones run after the others (128 at 4 programs of 4 warps).
MAX_REGISTERS = REGISTERS_PER_SM // (PROGRAMS_PER_SM * NUM_WARPS * 32)
# Excesses measured with a Triton release and accepted until the kernel changes:
# (Triton version prefix, arch, kernel) -> (registers, spilled bytes) accepted up to.
# The check lists them as known instead of failing; more than these still fails.
# Delete an entry to make the check strict again.
KnownExcesses = dict[tuple[str, int, str], tuple[int, int]]
KNOWN_EXCESSES: KnownExcesses = {
    # 4-byte elements: 136 registers, 3 programs fit an SM (2026-12, Triton 3.6.0).
    ("3.6.", 80, "unpack_tiles"): (136, 0),
    # ptxas 13.4 stores and loads 4 bytes when row_numel is not 16-divisible (Triton 3.9.0;
    # the same 126 variants on Triton 3.8.0, torch 2.14's).
    ("3.8.", 100, "pack_tiles"): (MAX_REGISTERS, 8),
    ("3.9.", 100, "pack_tiles"): (MAX_REGISTERS, 8),
}
DEFAULT_WORKERS = 2
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class CompileResult:
    """One variant compiled for one arch: its resources, or the error."""

    label: str
    kernel: str
    arch: int
    registers: int = 0
    spill_bytes: int = 0
    seconds: float = 0.0
    error: str = ""

    def problem(self, max_registers: int) -> str | None:
        """Why this result fails the check, or ``None``."""
        where = f"sm_{self.arch} {self.label}"
        if self.error:
            return f"{where}: compile error:\n{self.error}"
        if self.spill_bytes:
            return f"{where}: spills {self.spill_bytes} bytes ({self.registers} registers)"
        if self.registers > max_registers:
            return f"{where}: {self.registers} registers per thread > {max_registers}"
        return None


@dataclass(frozen=True)
class _Task:
    kernels_path: str
    module_name: str
    variant: KernelVariant
    arch: int


def _init_worker(cache_dir: str) -> None:
    # A fresh cache makes every variant run ptxas, whose log gives registers and spills.
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")


def _error_text(error: BaseException, kernels_path: str) -> str:
    """The error with its source: for a Triton frontend error, the innermost failing
    line (in its ``@jit`` function) and the call sites that led there."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    frontend = [e for e in chain if type(e).__name__ == "CompilationError"]
    if not frontend:
        return f"{type(chain[0]).__name__}: {chain[0]}"
    calls = [str(e).strip().splitlines() for e in frontend[:-1]]
    via = "".join(f"\n  via {lines[0]} {lines[-2].strip()}" for lines in calls if len(lines) > 1)
    return f"in {kernels_path}:\n{frontend[-1]}{via}"


def _compile(task: _Task) -> CompileResult:
    """Compiles one variant (in a worker process)."""
    variant = task.variant
    label = variant.label()
    start = time.perf_counter()
    try:
        module = sys.modules.get(task.module_name) or load_kernels(task.kernels_path,
                                                                   task.module_name)
        source = triton.compiler.ASTSource(getattr(module, variant.kernel), variant.signature,
                                           variant.constexprs, variant.attrs)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            triton.compile(source, target=GPUTarget("cuda", task.arch, 32),
                           options=dict(variant.options))
    except Exception as error:  # noqa: BLE001  (any failure is the check's finding)
        return CompileResult(label, variant.kernel, task.arch,
                             seconds=time.perf_counter() - start,
                             error=_error_text(error, task.kernels_path))
    text = log.getvalue()
    registers, spills = _REGISTERS.search(text), _SPILLS.search(text)
    if registers is None or spills is None:
        return CompileResult(label, variant.kernel, task.arch,
                             seconds=time.perf_counter() - start,
                             error=f"no register count in the ptxas log:\n{text[-2000:]}")
    return CompileResult(label, variant.kernel, task.arch, int(registers.group(1)),
                         int(spills.group(1)) + int(spills.group(2)),
                         time.perf_counter() - start)


@dataclass(frozen=True)
class Report:
    """All results of a check and its wall time."""

    results: list[CompileResult]
    seconds: float
    max_registers: int

    known_excesses: KnownExcesses

    def _known(self, result: CompileResult) -> str | None:
        for (version, arch, kernel), limits in self.known_excesses.items():
            if (triton.__version__.startswith(version) and result.arch == arch
                    and result.kernel == kernel and not result.error
                    and result.registers <= limits[0] and result.spill_bytes <= limits[1]):
                return f"Triton {version}x accepts {limits[0]} registers, {limits[1]} bytes spilled"
        return None

    @property
    def problems(self) -> list[str]:
        """Why the check fails: one line per failing variant (known excesses excepted)."""
        return [p for r in self.results
                if (p := r.problem(self.max_registers)) and self._known(r) is None]

    @property
    def known(self) -> list[str]:
        """Excesses listed in ``known_excesses``, with what was measured before."""
        return [f"{p} [known: {self._known(r)}]" for r in self.results
                if (p := r.problem(self.max_registers)) and self._known(r) is not None]

    def summary(self) -> str:
        """Per kernel and arch: variants, register range, spills; then the problems."""
        lines = []
        groups: dict[tuple[str, int], list[CompileResult]] = {}
        for result in self.results:
            groups.setdefault((result.kernel, result.arch), []).append(result)
        for (kernel, arch), results in sorted(groups.items()):
            ok = [r for r in results if not r.error]
            registers = [r.registers for r in ok] or [0]
            lines.append(
                f"sm_{arch} {kernel}: {len(results)} variants, {len(results) - len(ok)} "
                f"errors, registers {min(registers)}-{max(registers)}, "
                f"spills {sum(r.spill_bytes for r in ok)} bytes")
        compile_seconds = sum(r.seconds for r in self.results)
        lines.append(f"{len(self.results)} compiles in {self.seconds:.1f} s "
                     f"({compile_seconds:.1f} s of compiling), Triton {triton.__version__}")
        known, problems = self.known, self.problems
        if known:
            lines += [f"KNOWN ({len(known)}, not failing):", *known]
        lines += [f"FAILED ({len(problems)}):", *problems] if problems else ["OK"]
        return "\n".join(lines)


def check(
    archs: Sequence[int] = ARCHS,
    sample_archs: Sequence[int] = (),
    workers: int = DEFAULT_WORKERS,
    max_registers: int = MAX_REGISTERS,
    kernels: ModuleType | None = None,
    variants: Sequence[KernelVariant] | None = None,
    known_excesses: KnownExcesses | None = None,
) -> Report:
    """Compiles the kernels' CUDA variants for each arch.

    Args:
        archs: compute capabilities (80: sm_80, 90: sm_90, 100: sm_100) to compile
            every variant for.
        sample_archs: compute capabilities to compile a pairwise covering of the
            variants for (see :mod:`.variant_sample`).
        workers: compiling processes.
        max_registers: most registers a thread may use.
        kernels: ``kernels.py`` in compiled mode (default: the package's); loaded from
            its file in each worker.
        variants: the variants to compile for every arch of ``archs`` (default: all
            of :func:`~tests.triton_kernels.cuda_variants.cuda_variants`, per arch).
        known_excesses: excesses that do not fail the check (default:
            :data:`KNOWN_EXCESSES`; ``{}``: strict).

    Returns:
        The :class:`Report`; ``report.problems`` is empty when the check passes.

    Raises:
        ValueError: no archs, an arch in both lists, or ``workers`` or
            ``max_registers`` below 1.
    """
    if not (archs or sample_archs) or set(archs) & set(sample_archs):
        raise ValueError(f"need at least one arch, each in one list; got archs={list(archs)}, "
                         f"sample_archs={list(sample_archs)}")
    if workers < 1 or max_registers < 1:
        raise ValueError(f"need workers >= 1 and max_registers >= 1; got workers={workers}, "
                         f"max_registers={max_registers}")
    if kernels is None:
        from fsdp_traceable.triton_kernels.loader import kernels_module

        kernels = kernels_module(False)
    tasks = [_Task(kernels.__file__, kernels.__name__, variant, arch)
             for arch in archs
             for variant in (variants if variants is not None else cuda_variants(kernels, arch))]
    tasks += [_Task(kernels.__file__, kernels.__name__, variant, arch)
              for arch in sample_archs
              for variant in pairwise_sample(cuda_variants(kernels, arch))]
    start = time.perf_counter()
    methods = multiprocessing.get_all_start_methods()
    # fork: workers inherit the loaded kernels instead of importing everything again.
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with tempfile.TemporaryDirectory(prefix="triton-gpu-targets-") as cache_dir, \
            ProcessPoolExecutor(workers, context, _init_worker, (cache_dir,)) as pool:
        results = list(pool.map(_compile, tasks, chunksize=4))
    return Report(results, time.perf_counter() - start, max_registers,
                  KNOWN_EXCESSES if known_excesses is None else known_excesses)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: runs :func:`check` and prints its summary.

    Returns:
        0 when every variant compiles within the limits, else 1.
    """
    parser = argparse.ArgumentParser(prog="python -m tests.triton_kernels.gpu_targets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="*", default=None,
                        help="compute capabilities to compile every variant for "
                             "(default: 80 90 100 less the sampled ones)")
    parser.add_argument("--sample-arch", type=int, nargs="*", default=[],
                        help="compute capabilities to compile a pairwise covering for")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--max-registers", type=int, default=MAX_REGISTERS)
    parser.add_argument("--strict", action="store_true",
                        help="fail on the known excesses (KNOWN_EXCESSES) too")
    args = parser.parse_args(argv)
    archs = args.arch if args.arch is not None else [
        a for a in ARCHS if a not in args.sample_arch]
    report = check(archs, args.sample_arch, args.workers, args.max_registers,
                   known_excesses={} if args.strict else None)
    print(report.summary())
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
