"""One graph for the whole training step: :func:`compile_step`.

[Note: whole-step capture]
With ``torch._dynamo.config.trace_autograd_ops`` Dynamo traces ``loss.backward()``
(and ``torch.autograd.grad``) inside the compiled function, so forward, loss and
backward become one forward-loss-backward graph: AOTAutograd compiles it as one
inference graph, and Inductor schedules every group's all-gather and reduce-scatter
in it, across the forward/backward boundary. Nothing of ``fully_shard`` changes: its
traced path is the one compile + compiled autograd takes, and its reduce-scatter
still runs in each group's ``autograd.Function`` backward. A group that reshards
after forward tags its all-gather must-recompute; torch's forward-loss-backward
rematerialization pass then gathers again right before the backward that uses it,
so no unsharded parameter lives from forward to backward. That pass needs the
backward to be one contiguous region, which the Function backwards break on torch
(see ``_torch_patches.complete_whole_step_recompute``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import types
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch

from .. import _torch_patches
from .. import config as fsdp_config
from ..tracing import forward_regions_enabled, regions_available
from .graph_pass_key import keyed_by_graph_passes
from .step_cache import PrecompiledStep, precompile_available
from .traced_optimizer import TracedOptimizer

__all__ = ["compile_step", "dynamo_traces_backward_into_dtensors"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def dynamo_traces_backward_into_dtensors() -> bool:
    """Whether this torch's Dynamo traces ``backward()`` into DTensor parameters.

    Every torch whose Dynamo traces ``backward()`` (``trace_autograd_ops``, 2.11+):
    2.12 on take tensor subclasses; torch 2.11 asserts every tensor it differentiates
    is a plain fake tensor, which :func:`compile_step` completes with a torch patch
    (``_torch_patches.trace_backward_into_subclasses``).
    """
    return _torch_patches.dynamo_traces_backward()


def _cacheable_functions() -> contextlib.AbstractContextManager:
    """AOTAutograd's cache takes graphs holding a Dynamo-traced ``autograd.Function``.

    It bypasses them by default, so a restarted process traced the whole step again
    (measured: 9.8 s to a warm first step at 4 blocks, 6.1 s with the cache). Safe
    here: Dynamo traces ``fully_shard``'s Functions into the graph, forward and
    backward, so the cache key holds everything they do.
    """
    if not hasattr(torch._functorch.config, "autograd_cache_allow_custom_autograd_functions"):
        return contextlib.nullcontext()
    return torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True)


@contextlib.contextmanager
def _region_errors_name_the_switch() -> Iterator[None]:
    """Turns torch's error for a forward region that returns a view of its input into
    one naming ``config.forward_regions`` (see [Note: region outputs])."""
    try:
        yield
    except Exception as error:
        if forward_regions_enabled() and _is_region_aliasing(error):
            raise RuntimeError(
                "a fully_shard module's forward returned a view of its input, which a "
                "nested compile region cannot return (torch's error above); with "
                "fsdp_traceable.config.forward_regions on (the default on torch 2.13+) "
                "each such forward runs as one. Return a new tensor (e.g. .clone()), or "
                "set fsdp_traceable.config.forward_regions = False"
            ) from error
        raise


def _is_region_aliasing(error: BaseException | None) -> bool:
    while error is not None:
        message = str(error)
        if "invoke_subgraph" in message and "aliasing" in message:
            return True
        error = error.__cause__ or error.__context__
    return False


def _structured_trace_on() -> bool:
    """Whether torch writes its structured trace (tlparse's input) in this process."""
    handler = getattr(torch._logging._internal, "LOG_TRACE_HANDLER", None)
    return (getattr(handler, "root_dir", None) is not None
            or bool(os.environ.get("TORCH_TRACE") or os.environ.get("TORCH_DTRACE"))
            or os.environ.get("TORCH_COMPILE_DEBUG") == "1")


def _dynamo_settings() -> dict[str, object]:
    """The Dynamo config a step traces under (one ``config.patch`` per call).

    ``trace_autograd_ops``: Dynamo traces ``backward()``. And Dynamo keeps no record of
    the side effects it replays that nothing would read: under its default policy
    (``side_effect_replay_policy="info"``) it captures the user stack of every mutation
    it replays (every group's state, every block's) and formats each into a message for
    ``TORCH_LOGS="side_effects"`` and the structured trace: measured, 1.3 s of 8.1 s of
    Dynamo at 16 blocks (``aot_eager``, two paired runs). Where neither is on and the
    policy is the default, the step traces under ``"silent"``, which replays the same
    side effects without those records.
    """
    settings: dict[str, object] = {"trace_autograd_ops": True}
    if getattr(torch._dynamo.config, "side_effect_replay_policy", None) != "info":
        return settings
    side_effects_log = torch._logging.getArtifactLogger("torch._dynamo.side_effects",
                                                        "side_effects")
    if not (side_effects_log.isEnabledFor(logging.DEBUG) or _structured_trace_on()):
        settings["side_effect_replay_policy"] = "silent"
    return settings


def _check_forward_regions() -> None:
    if fsdp_config.forward_regions is True and not regions_available():
        raise RuntimeError(
            f"fsdp_traceable.config.forward_regions needs a torch whose "
            f"nested_compile_region reuses a region by key (2.13 or newer); torch "
            f"{torch.__version__} has none: set forward_regions = None (on where "
            f"available) or False"
        )


def compile_step(
    step: Callable[_P, _R],
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Callable[_P, _R]:
    """Compiles a whole training step, forward, loss and ``loss.backward()``, into one graph.

    ``step`` is the training step as you write it eagerly over ``fully_shard``-ed
    modules: it runs the model, computes the loss, calls ``loss.backward()`` and
    returns what it likes (typically the detached loss). Gradients land in ``.grad``
    as DTensors, exactly as in eager; groups with ``reshard_after_forward=True``
    all-gather again in the backward instead of keeping their unsharded parameters.
    Call ``optimizer.step()`` and ``zero_grad()`` after the compiled step, or pass
    ``optimizer`` to have them traced into it (torch's optimizers graph-break at
    ``step()`` on purpose). Compiled with
    ``fullgraph=True``: a graph break is an error, never a silent split. A restarted
    process finds the step in AOTAutograd's and Inductor's caches. With forward
    regions (``fsdp_traceable.config.forward_regions``, on by default from torch 2.13)
    identical blocks are traced and compiled once: each ``fully_shard`` module's
    forward runs as one call of a shared nested compile region (see [Note: forward
    regions]).

    Args:
        step: the training step.
        backend: ``torch.compile``'s backend.
        mode: ``torch.compile``'s mode.
        options: ``torch.compile``'s backend options.
        dynamic: ``torch.compile``'s ``dynamic``.
        cache_dir: a folder where the first call saves the compiled step (one file per
            rank) and where a restarted process loads it from instead of compiling
            (see [Note: precompiled steps]); the step's arguments must then be tensors
            and plain values, and the modules it uses reached from its closure or
            globals.
        optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW``: the compiled step
            ends with its ``step()`` and ``zero_grad()`` (``set_to_none``) in the same
            graph, its learning rate read at every call (a schedule does not
            recompile; see [Note: the optimizer in the step]); with ``cache_dir`` its
            settings are part of the saved step's key.

    Returns:
        The compiled step, called as ``step``.

    Raises:
        TypeError: if ``step`` is not callable, or ``optimizer`` is of another type, or
            comes with a ``step`` that is not a Python function (a bound method).
        ValueError: if ``optimizer`` has a setting its traced update cannot honour (step
            hooks, ``differentiable``, SGD's ``dampening`` with momentum).
        RuntimeError: if this torch cannot trace ``backward()`` (before 2.11: use
            ``torch.compile`` with compiled autograd); at a
            call, if ``config.forward_regions`` is ``True`` and this torch cannot key a
            region (before 2.13), or if a forward run as a region returns a view of its
            input.
    """
    if not callable(step):
        raise TypeError(f"compile_step(step=...) takes the training step function, got {step!r}")
    if not dynamo_traces_backward_into_dtensors():
        raise RuntimeError(
            f"compile_step needs a torch whose Dynamo traces backward() "
            f"(torch._dynamo.config.trace_autograd_ops, 2.11 or newer); torch "
            f"{torch.__version__} cannot. Compile the model with compiled autograd "
            "instead (see the recipes in the README)"
        )
    if cache_dir is not None and not precompile_available():
        raise RuntimeError(
            f"compile_step(cache_dir=...) saves the compiled step with torch.compile's "
            f"aot_compile, which torch {torch.__version__} does not have: drop cache_dir "
            "(AOTAutograd's and Inductor's caches still serve a restart)"
        )
    if cache_dir is not None and options and "guard_filter_fn" in options:
        raise ValueError(
            "compile_step(cache_dir=...) chooses the guards a saved step keeps: remove "
            "'guard_filter_fn' from options"
        )
    traced_optimizer = TracedOptimizer(optimizer) if optimizer is not None else None
    compiled_function = (step if traced_optimizer is None
                         else _followed_by_update(step, traced_optimizer))
    _torch_patches.trace_backward_into_subclasses()
    _torch_patches.complete_whole_step_recompute()

    def compile_with(guard_filter_fn: Callable[..., Any] | None = None) -> Any:
        step_options = dict(options or {})
        if guard_filter_fn is not None:
            step_options["guard_filter_fn"] = guard_filter_fn
        return torch.compile(compiled_function, fullgraph=True, backend=backend, mode=mode,
                             options=step_options or None, dynamic=dynamic)

    def tracing() -> contextlib.AbstractContextManager:
        _check_forward_regions()
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(_dynamo_settings()))
        stack.enter_context(_cacheable_functions())
        stack.enter_context(keyed_by_graph_passes())
        stack.enter_context(_region_errors_name_the_switch())
        return stack

    compiled = compile_with()

    @functools.wraps(step)
    def compiled_step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with tracing():
            return compiled(*args, **kwargs)

    if cache_dir is not None:
        precompiled = PrecompiledStep(step, cache_dir, compile_fn=compile_with,
                                      tracing_context=tracing, fallback=compiled_step,
                                      optimizer=traced_optimizer, compiled=compiled_function)
        return functools.wraps(step)(precompiled)
    if traced_optimizer is None:
        return compiled_step

    @functools.wraps(step)
    def prepared_step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        traced_optimizer.prepare()
        return compiled_step(*args, **kwargs)

    return prepared_step


# How a parameter of each kind is passed on (by name, otherwise).
_PASSED_AS = {inspect.Parameter.VAR_POSITIONAL: "*{}", inspect.Parameter.KEYWORD_ONLY: "{0}={0}",
              inspect.Parameter.VAR_KEYWORD: "**{}"}


def _followed_by_update(step: Callable[_P, _R], optimizer: TracedOptimizer) -> Callable[_P, _R]:
    """``step`` then the optimizer's traced update and ``zero_grad()``, one function.

    Made to look to Dynamo as ``step`` itself does, so that a saved step
    (``cache_dir``) keeps the same guards as a step without the optimizer: the same
    parameters (guards on ``*args``' length and ``**kwargs``' keys are not portable,
    and a saved step holding one keeps every guard on dict key order, which it cannot
    check), and as cells of its own closure ``step``'s own cells for the modules
    ``step`` closes over, each read first, so Dynamo names them from this frame (read
    through ``step``, a saved step's guards on them were built from a saved copy of
    ``step``, in which the modules are missing).
    """
    if not inspect.isfunction(step):
        raise TypeError(
            f"compile_step(step, optimizer=...) follows step's own frame and takes a Python "
            f"function; got {type(step).__name__} {step!r}: wrap it, e.g. "
            "lambda tokens, targets: trainer.step(tokens, targets)"
        )
    code = step.__code__
    cells = dict(zip(code.co_freevars, step.__closure__ or ()))
    modules = [name for name, cell in cells.items()
               if isinstance(cell.cell_contents, torch.nn.Module)]
    # The frame's own parameters (not a wrapped function's), without annotations and
    # defaults: the defaults are the step's own, set on the function below.
    signature = inspect.signature(step, follow_wrapped=False)
    parameters = [p.replace(annotation=p.empty, default=p.empty)
                  for p in signature.parameters.values()]
    header = signature.replace(parameters=parameters, return_annotation=signature.empty)
    arguments = ", ".join(_PASSED_AS.get(p.kind, "{}").format(p.name) for p in parameters)
    function_name = code.co_name if code.co_name.isidentifier() else "step"  # (a lambda)
    source = (
        f"def _factory({', '.join([*modules, '_fsdp_step', '_fsdp_optimizer'])}):\n"
        f"    def {function_name}{header}:\n"
        + "".join(f"        {module}.training\n" for module in modules)
        + f"        _fsdp_output = _fsdp_step({arguments})\n"
        "        _fsdp_optimizer.update()\n"
        "        return _fsdp_output\n"
        f"    return {function_name}\n"
    )
    scope: dict[str, Any] = {"__name__": __name__}
    exec(compile(source, f"<{__name__}: {function_name} and its optimizer's update>", "exec"),
         scope)
    made = scope["_factory"](*[cells[module].cell_contents for module in modules], step, optimizer)
    closure = tuple(cells[free] if free in modules else cell
                    for free, cell in zip(made.__code__.co_freevars, made.__closure__))
    function = types.FunctionType(made.__code__, made.__globals__, function_name,
                                  step.__defaults__, closure)
    function.__kwdefaults__ = step.__kwdefaults__
    return function
