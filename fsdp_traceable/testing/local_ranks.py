"""Real process groups on one machine: local gloo ranks on 127.0.0.1, and the
set-up and teardown every launcher of the library shares."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing.context
import multiprocessing.forkserver
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "free_port",
    "init_default_group",
    "local_rank_context",
    "run_and_shut_down",
    "run_on_local_ranks",
    "shut_down_process_group",
]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for local ranks to meet at."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_default_group(
    rank: int, world_size: int, init_method: str | None, timeout_s: float,
    backend: str | None = None,
) -> None:
    """The default process group with a ``timeout_s`` collective timeout; ``backend``
    defaults to NCCL on a machine with a GPU, else gloo."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_and_shut_down(fn: Callable[..., Any], args: tuple) -> None:
    """Runs ``fn``; after a success every rank meets at a barrier before tearing down,
    so no rank closes its connections while a peer is still using them (gloo aborts
    the peer's process then). After a failure the ranks tear down at once."""
    try:
        fn(*args)
        dist.barrier()
    finally:
        shut_down_process_group()


def shut_down_process_group() -> None:
    """Destroys the default process group, then drops what may still hold a process
    group: compiled code keeps its model alive, and the model's parameter groups keep
    their process group. Released here, a gloo process group is destroyed while the
    interpreter is whole; destroyed during interpreter shutdown, with work still held by
    its threads, it can abort the process."""
    dist.destroy_process_group()
    torch._dynamo.reset()
    gc.collect()


# [Note: preloaded rank processes]
# A spawned rank spends seconds importing torch, torch.distributed and this package before
# it runs a line of ``fn`` (about 8 s of CPU each on a 2-core machine). Ranks are therefore
# forked from a fork server that imported them once; the server forks before any rank
# state exists (no process group, no CUDA context, one thread), so each rank starts as
# clean as a spawned one. What differs is the environment: a forked rank imports nothing,
# so settings torch reads from the environment at import time (Inductor's and Dynamo's
# config) are the server's. A call whose environment differs from the server's in
# anything but the variables read at run time spawns its ranks instead; every rank
# starts with the caller's environment either way. So does a call whose standard output
# or error is no longer the file the server inherited (a redirected or captured stdout):
# a forked rank writes to the server's. A caller whose ranks compile with Inductor can
# have the server import Inductor and run its per-process CPU probes once
# (``preload_rank_server(inductor=True)``, before the first rank starts).
_PRELOADED_MODULES = ["torch", "torch.distributed", "fsdp_traceable"]
_INDUCTOR_WARMUP_MODULE = "fsdp_traceable.testing.inductor_warmup"
# Inductor writes the address of an object of its own process into this variable
# before every load of compiled code that reads it (after the first compile, the caller's
# environment holds it): a rank never needs the caller's value.
_PROCESS_OWN = frozenset({"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})
_READ_AT_RUN_TIME = frozenset({"TORCHINDUCTOR_CACHE_DIR", "PYTEST_CURRENT_TEST"}) | _PROCESS_OWN
_NOT_INHERITED = frozenset({"PYTEST_CURRENT_TEST"}) | _PROCESS_OWN


class _RankStarter:
    """Chooses how ranks start: forked from the preloaded fork server this class owns,
    or spawned where that server's environment no longer matches the caller's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server_env: dict[str, str] | None = None
        self._server_std_files: tuple | None = None
        self._preloaded_modules = list(_PRELOADED_MODULES)

    def add_preloaded_module(self, module: str) -> None:
        """Has the server import ``module`` too; only before the server starts."""
        with self._lock:
            if self._server_env is not None:
                raise RuntimeError(
                    f"the rank fork server already runs; preload {module!r} before the "
                    "first local rank or local_rank_context() call")
            if module not in self._preloaded_modules:
                self._preloaded_modules.append(module)

    @staticmethod
    def _std_files() -> tuple:
        """Which files standard output and error are (device, inode), as forked ranks
        would inherit them from the server."""
        files = []
        for fd in (1, 2):
            try:
                stat = os.fstat(fd)
                files.append((stat.st_dev, stat.st_ino))
            except OSError:
                files.append(None)
        return tuple(files)

    def start_method(self, passes_env: bool) -> str:
        """``"forkserver"`` where the preloaded server can start the ranks, else
        ``"spawn"`` (another fork server already runs in this process, or the
        environment or the standard output/error changed since ours started).
        ``passes_env``: the ranks set the caller's environment themselves, so
        variables read at run time may differ."""
        env = dict(os.environ)
        std_files = self._std_files()
        with self._lock:
            server = multiprocessing.forkserver._forkserver
            if self._server_env is None:
                if server._forkserver_pid is not None:
                    return "spawn"
                server.set_forkserver_preload(self._preloaded_modules)
                server.ensure_running()
                self._server_env = env
                self._server_std_files = std_files
            if std_files != self._server_std_files:
                return "spawn"
            ignored = _READ_AT_RUN_TIME if passes_env else _NOT_INHERITED
            same = all(env.get(k) == self._server_env.get(k)
                       for k in env.keys() | self._server_env.keys() if k not in ignored)
            return "forkserver" if same else "spawn"


_rank_starter = _RankStarter()


def preload_rank_server(inductor: bool = False) -> None:
    """Starts the fork server local ranks come from (see [Note: preloaded rank
    processes]), if it is not running yet.

    Args:
        inductor: also import Inductor's compiler and run its CPU instruction-set
            probes in the server, so that ranks which compile skip both (seconds of CPU
            per rank). Must be passed before the server starts.
    """
    if inductor:
        _rank_starter.add_preloaded_module(_INDUCTOR_WARMUP_MODULE)
    local_rank_context()


def local_rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context to start processes that act as local ranks with:
    forked from the preloaded server (see [Note: preloaded rank processes]) where the
    caller's environment is the server's, else spawn.

    Returns:
        A ``multiprocessing`` context.
    """
    return mp.get_context(_rank_starter.start_method(passes_env=False))


def _local_rank_main(
    rank: int, world_size: int, result_dir: str, fn: Callable[..., Any],
    args: tuple, timeout_s: float, num_threads: int, backend: str, env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)
    # A rank killed by a signal (a C++ abort in a collective's thread, a segfault) leaves
    # its Python stacks here for the parent's error.
    fault_file = open(os.path.join(result_dir, f"rank{rank}.fault"), "w")  # noqa: SIM115
    faulthandler.enable(fault_file, all_threads=True)
    torch.set_num_threads(num_threads)
    # One Inductor (and AOTAutograd) cache per rank: ranks of one job compile different
    # shapes under the same graph key where shards are uneven, and a rank loading a
    # peer's cached code fails its size checks (and its peers then wait on it).
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "fsdp_traceable_inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{rank}")
    # The ranks meet at a file store in the call's own directory, not at a TCP port:
    # a port chosen free by the parent can be taken by another process before rank 0
    # listens on it (parallel test workers open many connections), and a rank that
    # reached another job's store would join that job.
    store_path = os.path.join(result_dir, "store")
    init_default_group(rank, world_size, f"file://{store_path}", timeout_s, backend=backend)

    def run_and_save() -> None:
        torch.save(fn(rank, world_size, *args), os.path.join(result_dir, f"rank{rank}.pt"))

    run_and_shut_down(run_and_save, ())
    faulthandler.disable()
    fault_file.close()


def _signal_report(result_dir: str, world_size: int) -> str:
    """What the ranks' fault handlers wrote: the Python stacks of a rank killed by a
    signal."""
    reports = []
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.fault")
        if os.path.exists(path) and os.path.getsize(path):
            with open(path) as f:
                reports.append(f"rank {rank}:\n{f.read()[-8000:]}")
    return "\n".join(reports) or "(no rank wrote a fault report)"


def run_on_local_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    num_threads: int = 1,
    backend: str = "gloo",
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` new processes
    (gloo; ``backend="nccl"`` puts rank ``r`` on GPU ``r``), forked from a server that
    has imported torch and this package (see [Note: preloaded rank processes]).

    A failure on any rank fails the call with that rank's traceback (a rank killed by
    a signal: with the Python stacks of its threads at the signal); a rank that waits
    on a collective longer than ``timeout_s`` raises instead of hanging.

    Args:
        fn: the per-rank body, a module-level function.
        world_size: ranks to spawn.
        *args: more arguments for ``fn`` (picklable).
        timeout_s: collective timeout.
        num_threads: intra-op threads per rank.
        backend: the process group backend.

    Returns:
        Each rank's return value, by rank (``torch.save``-able values).
    """
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.start_processes(
                _local_rank_main,
                args=(world_size, result_dir, fn, args, timeout_s, num_threads, backend,
                      dict(os.environ)),
                nprocs=world_size, join=True,
                start_method=_rank_starter.start_method(passes_env=True),
            )
        except mp.ProcessExitedException as exc:
            raise RuntimeError(
                f"{exc}; Python stacks at the signal:\n{_signal_report(result_dir, world_size)}"
            ) from exc
        return [
            torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
