"""A whole training step compiled once, saved per rank, and loaded by a restarted process
without compiling: :func:`compile_step`'s ``cache_dir``.

[Note: precompiled steps]
``torch.compile(step, fullgraph=True).aot_compile(example_inputs)`` (torch 2.12+) returns
the step's Dynamo bytecode, guards and compiled graph as one object that
``save_compiled_function`` writes and ``torch.compiler.load_compiled_function`` reads back
in another process: no Dynamo trace, no AOTAutograd, no Inductor compile, so a restart
reaches its first step in the time it takes to load the kernels (on CPU without probing
the host's vector ISAs again where the saving process's probe applies: see [Note: the
CPU vector ISA probe]). The model the step closes over is not saved: the new process's
model is handed in at load (``external_data``), and so is its optimizer where the step
ends with the optimizer's update (``compile_step(optimizer=...)``).

Dynamo's guards on that model (its modules, the groups' settings, the parameters) cannot
be saved, so only the guards on the step's arguments and on global state are kept, and the
file is keyed instead by a fingerprint of everything those dropped guards stood for: the
torch and package versions, the world size and rank, the step's code, the model's module
types and parameter layouts, and each ``fully_shard`` group's settings. The source of every
function Dynamo inlined is checked against the saved checksums at load. A mismatch of any
of these is a miss, never a stale graph: the step compiles again and is saved under its new
key. Every rank loads or misses, then all agree on one answer (a MIN all-reduce over the
default group), so no rank runs the loaded graph while another compiles.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _torch_patches, config
from ..tracing import forward_regions_enabled
from . import cpu_isa_probe
from .traced_optimizer import TracedOptimizer

log = logging.getLogger(__name__)

_FORMAT = 1
# The names a step followed by its optimizer's update saves and loads those two under
# (external data).
_OPTIMIZER_KEY = "fsdp_traceable.optimizer"
_STEP_KEY = "fsdp_traceable.step"


def precompile_available() -> bool:
    """Whether this torch saves and loads compiled functions (2.12 and newer)."""
    compiled = torch.compile(lambda x: x, fullgraph=True)
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(compiled, "aot_compile")


class PrecompiledStep:
    """A step compiled ahead of time on its first call, or loaded from ``cache_dir``.

    Args:
        step: the training step (see :func:`~fsdp_traceable.compile_step`).
        cache_dir: the folder holding one file per rank and fingerprint.
        compile_fn: ``compile_fn(guard_filter_fn)`` returns ``torch.compile(compiled, ...)``
            with that guard filter, called within the whole-step tracing context.
        tracing_context: the context the step is traced in (``trace_autograd_ops``).
        fallback: the step compiled the usual way, for arguments the saved guards reject
            (e.g. another batch shape).
        optimizer: the optimizer traced into the step, if any: prepared before every
            call, handed in at load like the modules, its settings part of the key.
        compiled: the function ``compile_fn`` compiles: ``step``, or ``step`` followed by
            the optimizer's update.
    """

    def __init__(self, step: Callable[..., Any], cache_dir: str | os.PathLike, *,
                 compile_fn: Callable[[Callable[..., Any]], Any],
                 tracing_context: Callable[[], Any], fallback: Callable[..., Any],
                 optimizer: TracedOptimizer | None = None,
                 compiled: Callable[..., Any] | None = None) -> None:
        self._step = step
        self._compiled_function = compiled or step
        self._cache_dir = pathlib.Path(cache_dir)
        self._compile_fn = compile_fn
        self._tracing_context = tracing_context
        self._fallback = fallback
        self._optimizer = optimizer
        self._compiled: Any = None
        # What the first call did, "loaded" or "compiled", and this rank's file.
        self.source: str | None = None
        self.path: pathlib.Path | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._optimizer is not None:
            self._optimizer.prepare()
        if self._compiled is None:
            self._compiled = self._load_or_compile(args, kwargs)
        if self._compiled.guard_check(*args, **kwargs):
            return self._compiled(*args, **kwargs)
        return self._fallback(*args, **kwargs)

    def _load_or_compile(self, args: tuple, kwargs: dict) -> Any:
        external = dict(_closure_modules(self._step))
        key = fingerprint(self._step, external, args, kwargs, optimizer=self._optimizer)
        if self._optimizer is not None:
            external[_OPTIMIZER_KEY] = self._optimizer
            external[_STEP_KEY] = self._step
        path = self.path = self._cache_dir / f"step-{key}.bin"
        loaded = _load(path, self._compiled_function, external)
        if _all_ranks_agree(loaded is not None) and loaded is not None:
            self.source = "loaded"
            log.debug("whole step loaded from %s", path)
            return loaded
        with self._tracing_context():
            compiled = self._compile_fn(_argument_guards(self._step)).aot_compile((args, kwargs))
        _save(compiled, path, external)
        compiled.disable_guard_check()  # __call__ checks once per call
        self.source = "compiled"
        log.debug("whole step compiled and saved to %s", path)
        return compiled


def _argument_guards(step: Callable[..., Any]) -> Callable[[list[Any]], list[bool]]:
    """The guard filter that keeps what a saved step can check: global state, the shape
    environment, and guards on the step's own arguments (their shapes and dtypes; a step
    followed by its optimizer's update takes the same arguments)."""
    arguments = set(inspect.signature(step).parameters)

    def keep(entries: list[Any]) -> list[bool]:
        return [entry.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
                or entry.name.split(".")[0].split("[")[0] in arguments
                for entry in entries]

    return keep


def _closure_modules(step: Callable[..., Any]) -> dict[str, nn.Module]:
    """The modules the step reaches outside its arguments: its closure cells and the
    globals it names (what the saved function takes from the new process)."""
    code = step.__code__
    modules = {name: cell.cell_contents
               for name, cell in zip(code.co_freevars, step.__closure__ or ())
               if isinstance(cell.cell_contents, nn.Module)}
    for name in code.co_names:
        value = step.__globals__.get(name)
        if isinstance(value, nn.Module):
            modules[name] = value
    return modules


def fingerprint(step: Callable[..., Any], modules: dict[str, nn.Module],
                args: tuple, kwargs: dict, optimizer: TracedOptimizer | None = None) -> str:
    """The key of a saved step: what the guards dropped at saving stood for.

    Args:
        step: the training step.
        modules: the modules it closes over, by name.
        args: its positional arguments.
        kwargs: its keyword arguments.
        optimizer: the optimizer traced into the step, if any.

    Returns:
        A hex digest that changes when any of them changes in a way the graph depends on.
    """
    digest = hashlib.sha256()
    for part in _fingerprint_parts(step, modules, args, kwargs, optimizer, _package_version()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _package_version() -> str:
    try:
        return importlib.metadata.version("fsdp-traceable")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def _fingerprint_parts(step: Callable[..., Any], modules: dict[str, nn.Module], args: tuple,
                       kwargs: dict, optimizer: TracedOptimizer | None,
                       version: str) -> Iterator[str]:
    yield f"format={_FORMAT} torch={torch.__version__} fsdp_traceable={version}"
    # The library's switches that shape the traced graph.
    yield (f"config forward_regions={forward_regions_enabled()} "
           f"copy_kernels={config.copy_kernels} collectives_path={config.collectives_path}")
    if dist.is_initialized():
        yield f"world={dist.get_world_size()} rank={dist.get_rank()}"
    yield _code_digest(step.__code__)
    for name, value in [*enumerate(args), *sorted(kwargs.items())]:
        yield f"arg {name}: {_describe(value)}"
    from ..fsdp import FSDPModule

    for root_name, root in sorted(modules.items()):
        for path, module in root.named_modules(prefix=root_name):
            yield f"module {path}: {type(module).__module__}.{type(module).__qualname__}"
            if isinstance(module, FSDPModule):
                yield f"group {path}: {_group_settings(module._fsdp_group)}"
        for name, tensor in [*root.named_parameters(prefix=root_name),
                             *root.named_buffers(prefix=root_name)]:
            yield f"tensor {name}: {_describe(tensor)} requires_grad={tensor.requires_grad}"
    if optimizer is not None:
        yield f"optimizer {optimizer.describe()}"


def _code_digest(code: Any) -> str:
    digest = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        digest.update((_code_digest(const) if inspect.iscode(const) else repr(const)).encode())
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        placements = getattr(value, "placements", None)
        local = value.to_local() if placements is not None else value
        return (f"{type(value).__name__} {tuple(value.shape)} local {tuple(local.shape)} "
                f"{value.dtype} {value.device.type} {placements}")
    return f"{type(value).__qualname__} {value!r}" if isinstance(
        value, (bool, int, float, str, type(None))) else type(value).__qualname__


def _group_settings(group: Any) -> str:
    from ..fsdp.group_settings import SETTINGS

    settings = {name: _describe(getattr(group.settings, name)) for name in sorted(SETTINGS)}
    params = group.params
    settings["mp_policy"] = repr(params.mp_policy)
    settings["offload_to_cpu"] = repr(params.offload_to_cpu)
    settings["mesh"] = repr(tuple(params.mesh.shape))
    return json.dumps(settings, sort_keys=True)


def _source_checksums(compiled: Any) -> list[list[Any]]:
    """(module, first line, last line, sha256) of every function Dynamo inlined."""
    return sorted([source.module, source.firstlineno, source.lastlineno, source.checksum]
                  for source in compiled.source_info().inlined_sources)


def _sources_unchanged(checksums: list[list[Any]]) -> bool:
    for module_name, first, last, checksum in checksums:
        try:
            lines = inspect.getsourcelines(importlib.import_module(module_name))[0]
        except (ImportError, OSError, TypeError):
            return False
        source = "".join(lines[first - 1:last - 1])
        if hashlib.sha256(source.encode()).hexdigest() != checksum:
            return False
    return True


def _load(path: pathlib.Path, compiled: Callable[..., Any], external: dict[str, object]) -> Any:
    """The saved step at ``path`` if it exists and the code it inlined is unchanged;
    ``external``: what it takes from this process (its modules, the traced optimizer)."""
    sources = path.with_suffix(".sources.json")
    if not (path.is_file() and sources.is_file()):
        return None
    if not _sources_unchanged(json.loads(sources.read_text())):
        log.debug("whole step at %s: the code it inlined changed", path)
        return None
    # The CPU kernels it loads would make this process probe the host's vector ISAs.
    cpu_isa_probe.trust_saved_probe(path.with_suffix(".isa.json"))
    try:
        # Its kernels' libraries are found by key; precompiling their header would only
        # cost time (see skip_header_precompile_on_load).
        with path.open("rb") as file, _torch_patches.header_precompile_skipped():
            loaded = torch.compiler.load_compiled_function(
                file, f_globals=compiled.__globals__, external_data=external)
    except Exception as err:  # a damaged or foreign file: this rank compiles (and says so)
        log.warning("whole step at %s could not be loaded (%s: %s); compiling it again",
                    path, type(err).__name__, err)
        return None
    loaded.disable_guard_check()  # PrecompiledStep.__call__ checks once per call
    return loaded


def _save(compiled: Any, path: pathlib.Path, external: dict[str, object]) -> None:
    """Writes the step, its inlined sources' checksums and (on CPU) the outcome of the
    host's vector ISA probe (see [Note: the CPU vector ISA probe])."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu_isa_probe.save_probe(path.with_suffix(".isa.json"))
    _atomic_write(path.with_suffix(".sources.json"),
                  json.dumps(_source_checksums(compiled)).encode())
    compiled.save_compiled_function(str(path), external_data=external)


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as file:
        file.write(data)
    os.replace(file.name, path)


def _all_ranks_agree(loaded: bool) -> bool:
    """Whether every rank loaded its saved step (one MIN all-reduce on the default group)."""
    if not dist.is_initialized():
        return loaded
    backend = str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    flag = torch.tensor([int(loaded)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
