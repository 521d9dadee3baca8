"""Fixtures shared by ``tests/`` and ``compile_tests/`` (the root ``conftest.py``
registers them once for the run): a fake process group for single-process graph tests,
a fake mesh, collectives that fail if reached, this run's Inductor cache and the server
local ranks fork from.

Real multi-rank tests spawn gloo processes with
:func:`fsdp_traceable.testing.local_ranks.run_on_local_ranks`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_traceable.collectives import comm
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.testing.local_ranks import preload_rank_server
from fsdp_traceable.whole_step import cpu_isa_probe

# [Note: one Inductor compile thread in the suite]
# With more than one compile thread, every process that compiles with Inductor starts a
# compile-worker sidecar (a Python process importing torch) and its worker pool. The
# suite runs two test workers, each driving rank processes, on two cores: the cores are
# busy already, so the pools add process start-up and nothing else. The environment
# variable reaches rank processes and CLI subprocesses; the config is this process's.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])

# [Note: fewer CPU instruction-set probes in the suite]
# Inductor's first C++ compile in a process builds, per vector instruction set the CPU
# reports, a probe library and loads it in a Python subprocess that imports torch
# (``cpu_vec_isa.valid_vec_isa_list``), to learn which sets the compiler can build.
# ``vec_isa_ok`` takes the CPU's flags as the answer for the base probes, the ones that
# compile ATen's vector headers; only the AVX512-BF16 and AMX probes still run (6 of
# 10). Measured on the 2-core CI machine under load, empty cache: 46.6 s -> 5.3 s per
# process on torch 2.13; on torch 2.11's CUDA wheel each probe's torch import costs
# about 11 s (160 s -> 76 s). On these machines the base probes accept every set the
# CPU reports, so the generated code is the same. The fork server of local ranks runs
# what is left once (``rank_server``); other processes that compile (test workers,
# torchrun ranks, CLI subprocesses) each pay it. Inductor reads the variable at import
# (rank and CLI processes); the config is this process's.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
torch._inductor.config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"


@pytest.fixture
def fake_world() -> Iterator[None]:
    """Rank 0 of a 2-rank fake process group, with Dynamo's caches and counters reset
    before and after."""
    with fake_process_group(2):
        yield


@pytest.fixture
def one_gloo_rank(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo default group, with Dynamo reset before and after: its
    collectives move data (the fake group's do not), in this process."""
    store = dist.FileStore(str(tmp_path / "gloo_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


@pytest.fixture
def fake_mesh() -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh over a 2-rank fake process group (rank 0)."""
    with fake_process_group(2, reset_dynamo=False):
        yield init_device_mesh("cpu", (2,))


@pytest.fixture(scope="session", autouse=True)
def run_inductor_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This run's Inductor cache directory (one per test worker, empty at the start): the
    cache of every compile in the run, each rank process's in a ``rank<r>`` folder of it
    (:func:`~fsdp_traceable.testing.local_ranks.run_on_local_ranks`)."""
    cache_dir = tmp_path_factory.mktemp("inductor_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        yield cache_dir


@pytest.fixture(scope="session", autouse=True)
def rank_server(run_inductor_cache_dir: Path) -> None:
    """Starts the preloaded fork server local ranks come from, once per test worker and
    before any test captures its own output: the server's standard output and error
    are then the run's, and every later rank of the run forks from it (a server started
    inside a ``capfd`` test would make every other test's ranks spawn). The server
    imports Inductor and runs its CPU probes once, for every rank of the run that
    compiles."""
    preload_rank_server(inductor=True)


@contextlib.contextmanager
def kernel_cache_only(cache_dir: Path) -> Iterator[Path]:
    """Inductor with ``cache_dir`` as its cache and the graph-level caches off.

    Every graph is lowered and its code generated anew (the FX-graph and AOTAutograd
    caches key on the graph before our ops' decompositions, so a hit could serve code
    of another decomposition), while compiled kernels are reused across tests: they are
    keyed by their source, so a hit is the same kernel.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield cache_dir


@pytest.fixture
def inductor_cache(run_inductor_cache_dir: Path) -> Iterator[Path]:
    """:func:`kernel_cache_only` on this run's cache directory."""
    with kernel_cache_only(run_inductor_cache_dir):
        yield run_inductor_cache_dir


def _fail_collective(*args: object, **kwargs: object) -> None:
    raise AssertionError("a collective started before the bad input was rejected")


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective primitive raises: bad input must be rejected before one starts."""
    for name in ("all_gather", "all_gather_into", "start_reduce_scatter", "all_reduce", "wait"):
        monkeypatch.setattr(comm, name, _fail_collective)


def _forget_cpu_isa_probe() -> None:
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    classes, pending = set(), [cpu_vec_isa.VecISA]
    while pending:
        cls = pending.pop()
        classes.add(cls)
        pending.extend(cls.__subclasses__())
    for cls in classes:
        for value in vars(cls).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        for name in cpu_isa_probe._EXTENSIONS:
            isa.__dict__.pop(name, None)


@pytest.fixture
def forgotten_cpu_isa_probe(monkeypatch: pytest.MonkeyPatch
                            ) -> Iterator[tuple[list[list[str]], Callable[[], None]]]:
    """Inductor's CPU vector ISA probe as a new process finds it: nothing computed, no
    ISA's extension checked (``vec_isa_ok`` unset). Its load checks (child Python
    processes loading a test library) are recorded and succeed without running; the
    test libraries are built as usual (once per cache directory). Yields the load
    checks' command lines and a function forgetting the probe again (as the fixture
    does after the test)."""
    from torch._inductor import cpu_vec_isa

    loads: list[list[str]] = []
    real_run = subprocess.run

    def run(command: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess:
        if command[0] != sys.executable:
            return real_run(command, *args, **kwargs)
        loads.append(command)
        return subprocess.CompletedProcess(command, 0)

    _forget_cpu_isa_probe()
    monkeypatch.setattr(cpu_vec_isa.subprocess, "run", run)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": None}):
        yield loads, _forget_cpu_isa_probe
    monkeypatch.undo()
    _forget_cpu_isa_probe()
