"""A ``fully_shard``-ed module's state: the one object ``fully_shard.state(module)`` and
``module._get_fsdp_state()`` return, shaped as FSDP2's ``FSDPState`` where torch's own
code and FSDP2's users read it.

``fully_shard`` builds one :class:`FSDPModuleState` per call (shared by the modules of
a list), in one place, and stores it in the module's ``__dict__`` under torch's
composable-API registry key (where torch's ``contract`` decorator stores FSDP2's), so
``torch.distributed.fsdp.fully_shard.state`` finds it too; each module gets its own
:class:`ModuleEntry` (its forward's own parts, and the state) in the same place. It
holds what FSDP2's state holds: the call's parameter group (``FSDPModule._fsdp_group``
reads it here) and the groups its forward prefetches, the ``_lazy_init`` record and the
scopes of the forward methods torch's ``register_fsdp_forward_method`` wraps; it holds
its modules weakly.

What it answers, with FSDP2's meaning: ``_pre_forward`` / ``_post_forward`` (around a
registered forward method), ``_comm_ctx`` (``share_comm_ctx``), ``_is_root``,
``_lazy_init()`` (its checks; the groups are linked when the root's ``fully_shard``
runs), ``_modules_to_run_forward``, ``_fsdp_param_group`` (the module path and each
parameter's path), ``_state_ctx.all_states`` and the pipeline calls below.

See [Note: torch's FSDPState and ours].

[Note: pipeline schedules]
torch's pipeline stages and schedules take their FSDP path for any
``torch.distributed.fsdp.FSDPModule``, which ours are. Each microbatch's backward runs
after ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)`` (the groups accumulate unsharded gradients and
keep the parameters they gathered for backward); after the last one the stage sets
the three back to ``True`` and, outside any backward pass, reaches for FSDP2's state
through the composable-API registry: ``fully_shard.state(stage_module)``, then
``post_backward()`` on every parameter group of every state in
``state._state_ctx.all_states``, then ``state._root_post_backward_final_callback()``.
Interleaved schedules also call ``unshard(async_op=True)`` / ``reshard()`` per module.
``post_backward()`` reduce-scatters the group's accumulated gradients (and frees the
parameters kept for backward when ``reshard_after_backward`` is set); the final callback
finishes the model's reductions in flight, which writes ``.grad``. torch itself is not
changed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.hooks import RemovableHandle

from ..collectives import comm
from .mixed_fully_shard import fsdp2_lazy_init_root, mixed_error
from .module_hooks import InnerHooks

if TYPE_CHECKING:
    from .forward_hooks import ForwardScope
    from .param_group import ParamGroup

try:  # torch's composable-API registry: where fully_shard.state(module) looks
    from torch.distributed._composable.contract import STATE_KEY as _STATE_KEY
except ImportError:  # pragma: no cover - every supported torch has it
    _STATE_KEY = None
# The key fully_shard.state() reads: the function contract() decorated.
_STATE_FUNC = getattr(torch_fully_shard, "__wrapped__", None)

# [Note: replicate and fully_shard]
# torch's composable APIs also name themselves in a per-module registry, which is how
# torch's ``replicate`` (DDP) and FSDP2 leave each other's modules alone: ``replicate`` on
# an enclosing module skips the parameters of modules whose registry names
# "fully_shard" (and refuses such a module itself), and ``fully_shard`` skips modules
# whose registry names "replicate". Ours names itself there too, and skips the same
# modules (fsdp/fully_shard.py), so both orders compose as with FSDP2.
try:
    from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY
    from torch.distributed._composable.contract import RegistryItem as _RegistryItem
except ImportError:  # pragma: no cover - every supported torch has them
    _REGISTRY_KEY = _RegistryItem = None


# [Note: torch's FSDPState and ours]
# FSDPModuleState is an instance of torch's FSDPState and is entered in torch's
# module-to-state mapping (torch.distributed._composable_state), as FSDP2's state is:
# torch's code that looks a module's FSDP state up there then finds ours.
# - _get_managed_modules (torch's fully_shard on an enclosing module, and FSDP2's
#   users) leaves our modules and their parameters out, as it leaves FSDP2's nested
#   modules out.
# - FSDPModule._get_fsdp_state: ours overrides it (fsdp_module.py) and returns this.
# - replicate (torch's FSDP-based one) looks for its own state class only.
# - FSDP2's lazy init of an enclosing torch fully_shard root would take this state
#   over with FSDP2's internals (comm contexts, FSDPParam groups) that ours does not
#   have. Its first read of it (``_state_ctx`` on torch 2.15, ``_is_root`` before),
#   recognised by the caller's code object (FSDPState._lazy_init's), raises
#   MixedFullyShardError instead (writing ``_is_root`` always does), at the torch
#   root's first forward: apply our fully_shard to the enclosing modules too. (Before
#   the state was in the mapping, torch's fully_shard took our sharded parameters for
#   tensor-parallel ones and, on a mesh without dim names, failed inside torch with a
#   TypeError.)
# FSDPState.__init__ is not run: the attributes it sets are answered by this class's
# properties, or belong to FSDP2's hooks and lazy init, which ours does not use
# (FSDP2's hooks are registered by FSDPState.init, never called on ours). The mapping
# holds the module and the state weakly: the module's entry keeps its state alive, and
# the module going frees both.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as _TorchFSDPState
except ImportError:  # pragma: no cover - every supported torch has it
    _TorchFSDPState = object  # type: ignore[assignment,misc]
try:
    from torch.distributed._composable_state import _insert_module_state
except ImportError:  # pragma: no cover - every supported torch has it
    _insert_module_state = None


# Where each module's ModuleEntry lives (and so its state, also where this torch has no
# composable-API registry).
_OWN_KEY = "_fsdp_module_state"


# [Note: a module's own entry]
# FSDPModuleState is one per fully_shard call, shared by the modules of a list, as
# FSDP2's FSDPState. What each module's forward needs of its own, its user's forward
# hooks that run between the unshard and the reshard (module_hooks.InnerHooks), a
# forward set on the instance ([Note: instance forward]) and its compiled compute
# ([Note: per-module compile]), is one per module: it lives in the module's
# ModuleEntry, which is also how the module reaches its state (state_of). The entry,
# not the shared state, is what the module's __dict__ holds: FSDPModule.forward and
# _fsdp_compute are traced by Dynamo as one code object for every module of a class,
# so they must reach a module's own parts from ``self`` alone. A lookup by module in
# the shared state would key on id(self), and Dynamo guards an id() on the module's
# identity: every block would recompile the shared code (see [Note: per-module
# compile]).
# The binding of the unsharded parameters (``_fsdp_unsharded``, read by the
# parameter properties of unsharded_binding, and ``_fsdp_holders``) stays on each
# module that holds a parameter, which need not be a fully_shard-ed module and then
# has no state: the property of its swapped-in class reads it from ``self`` on every
# parameter read, forward and traced alike.


class ModuleEntry:
    """One ``fully_shard``-ed module's own part of its state (see [Note: a module's own
    entry]).

    Args:
        state: its ``fully_shard`` call's state.
        module: the module; its forward hook dicts move to :attr:`inner_hooks` and a
            forward set on the instance to :attr:`instance_forward`.
    """

    def __init__(self, state: FSDPModuleState, module: nn.Module) -> None:
        self.state = state
        # The user's forward hooks that run between the unshard and the reshard.
        self.inner_hooks = InnerHooks(module)
        # A forward set on the instance: see [Note: instance forward].
        self.instance_forward: Callable[..., Any] | None = module.__dict__.pop("forward", None)
        # module.compile()'s compiled compute: see [Note: per-module compile].
        self.compiled_compute: Callable[..., Any] | None = None
        # The root's check of [Note: shared parameters across groups], where it has one.
        self.shared_param_check: RemovableHandle | None = None


def register_state(modules: list[nn.Module], group: ParamGroup) -> FSDPModuleState:
    """Builds the :class:`FSDPModuleState` of one ``fully_shard`` call (one for the
    modules of a list) and each module's :class:`ModuleEntry`, and stores them where
    ``fully_shard.state`` (ours and torch's) finds the state.

    Args:
        modules: the modules :func:`~fsdp_traceable.fully_shard` was applied to.
        group: the call's parameter group.

    Returns:
        The state.
    """
    state = FSDPModuleState(modules, group)
    for module in modules:
        module.__dict__[_OWN_KEY] = ModuleEntry(state, module)
        if _insert_module_state is not None:  # see [Note: torch's FSDPState and ours]
            _insert_module_state(module, state)
        if _STATE_KEY is not None and _STATE_FUNC is not None:
            module.__dict__.setdefault(_STATE_KEY, {})[_STATE_FUNC] = state
        if _REGISTRY_KEY is not None:  # see [Note: replicate and fully_shard]
            module.__dict__.setdefault(_REGISTRY_KEY, {}).setdefault("fully_shard", _RegistryItem())
    return state


# [Note: shared parameters across groups]
# A parameter used by modules that separate fully_shard calls shard (a tied embedding
# and output projection sharded one by one) can only be in one group. As FSDP2,
# the later call accepts the modules, and the root's first forward raises FSDP2's
# ValueError, before any collective (FSDP2: its root's lazy init,
# _validate_no_duplicate_params). The later call leaves the parameter as it is, to
# the group that manages it (nothing is sharded twice), and records its path in its
# state's shared_params; the root's fully_shard (fully_shard._link_groups) gives the
# root a forward pre-hook, run before ours and torch's other hooks, that raises the
# error. The hook exists only where a parameter is shared so, and raises the same
# message when Dynamo traces it. _lazy_init() raises it too.


def shared_param_error(root: nn.Module) -> str | None:
    """The error of [Note: shared parameters across groups] for the first parameter under
    ``root`` left to another group, named by its path from ``root``; ``None`` if none."""
    for path, module in root.named_modules():
        state = state_of(module)
        if state is not None and state.shared_params and state._modules[0]() is module:
            fqn = state.shared_params[0]
            fqn = f"{path}.{fqn}" if path else fqn
            return (
                f"parameter {fqn!r} is shared with a parameter already managed by another "
                "FSDP group (fully_shard call); shared parameters must be in one group: pass "
                "the modules that use it together, fully_shard([module_a, module_b]), or "
                "apply fully_shard to a common ancestor of them"
            )
    return None


def arm_shared_param_check(root: nn.Module) -> None:
    """Gives ``root`` (the latest ``fully_shard`` call, its groups just linked) the
    forward pre-hook of [Note: shared parameters across groups] where a parameter under
    it is shared across groups, and takes it off the states below it, no longer roots.

    Args:
        root: the root ``fully_shard``-ed module.
    """
    for module in root.modules():
        entry = module.__dict__.get(_OWN_KEY)
        if entry is not None and entry.shared_param_check is not None:
            entry.shared_param_check.remove()
            entry.shared_param_check = None
    message = shared_param_error(root)
    if message is None:
        return

    def raise_shared_param_error(module: nn.Module, args: tuple) -> None:
        raise ValueError(message)

    # nn.Module's own registration: FSDPModule's runs a hook between unshard and reshard.
    entry_of(root).shared_param_check = nn.Module.register_forward_pre_hook(
        root, raise_shared_param_error, prepend=True)


def replicated(module: nn.Module) -> bool:
    """Whether torch's ``replicate`` manages ``module`` (see [Note: replicate and
    fully_shard]): ``fully_shard`` then leaves it and its submodules alone."""
    registry = module.__dict__.get(_REGISTRY_KEY) if _REGISTRY_KEY is not None else None
    return registry is not None and "replicate" in registry


def state_of(module: nn.Module) -> FSDPModuleState | None:
    """``fully_shard.state(module)``: the module's state, or ``None`` if ``fully_shard``
    was not applied to it."""
    entry = module.__dict__.get(_OWN_KEY)
    return None if entry is None else entry.state


def entry_of(module: nn.Module) -> ModuleEntry:
    """A ``fully_shard``-ed module's own entry (see [Note: a module's own entry])."""
    return module.__dict__[_OWN_KEY]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return _OWN_KEY in module.__dict__


@dataclasses.dataclass(frozen=True)
class _ParamView:
    """A parameter as FSDP2's ``FSDPParam`` names it."""

    _param_fqn: str


class _GroupView:
    """A parameter group as FSDP2's ``FSDPParamGroup`` is read from outside: the stage
    code's ``post_backward()``, the module and parameter paths, and the ``comm_ctx``
    that ``share_comm_ctx`` assigns (the state's ``_comm_ctx`` setter applies it)."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group
        self.comm_ctx: object = None

    def post_backward(self, *unused: object) -> None:
        """Reduce-scatters the group's accumulated gradients (FSDP2's meaning)."""
        self._group.post_backward_outside_backward()

    @property
    def _module_fqn(self) -> str:
        return self._group.name

    @property
    def is_unsharded(self) -> bool:
        """Whether the group holds its unsharded parameters (torchtitan's chunked loss
        checks it between ``set_reshard_after_forward/backward(False)`` chunks)."""
        return self._group.holds_unsharded

    @property
    def fsdp_params(self) -> list[_ParamView]:
        return [_ParamView(fqn) for fqn in self._group.params.fqns]


class _StateContext:
    """FSDP2's ``_state_ctx``: the states of every ``fully_shard`` call under the
    module asked (itself first, pre-order), each once."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    @property
    def all_states(self) -> list[FSDPModuleState]:
        states = (state_of(m) for m in self._module.modules())
        return list({id(s): s for s in states if s is not None}.values())

    @property
    def is_last_backward(self) -> bool:
        return True  # nothing of ours waits for it (see FSDPModule.set_is_last_backward)


class FSDPModuleState(_TorchFSDPState):
    """One ``fully_shard`` call's state, an instance of torch's ``FSDPState`` shaped as
    FSDP2's where torch's code reads it (see the module docstring and [Note: torch's
    FSDPState and ours]). Holds its modules weakly: a module's state never keeps it
    alive."""

    def __init__(self, modules: list[nn.Module], group: ParamGroup) -> None:
        # FSDPState.__init__ is not run: see [Note: torch's FSDPState and ours].
        self._modules = [weakref.ref(m) for m in modules]
        # FSDP2's _fsdp_param_group: the call's parameters, settings and life cycle.
        self.group = group
        # FSDP2's _states_to_forward_prefetch, as groups: what this call's forward
        # all-gathers ahead (the next group in module order, or as set explicitly).
        self.next_groups: list[ParamGroup] = []
        # Whether _lazy_init ran on it, and as the root of what it initialized.
        self._lazy_initialized = False
        # The scopes of the registered forward methods running now (they nest).
        self._scopes: list[ForwardScope] = []
        # Paths (from the call's module) of the parameters this call left to the group
        # that already manages them: see [Note: shared parameters across groups].
        self.shared_params: list[str] = []

    def _owner(self) -> nn.Module:
        module = self._modules[0]()
        if module is None:
            raise RuntimeError("the module of this fully_shard state was freed")
        return module

    @property
    def _group(self) -> ParamGroup:
        return self.group

    # -- torch's register_fsdp_forward_method ---------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        group = module._fsdp_group
        args, kwargs, scope = group.pre_forward(module, args, kwargs)
        self._scopes.append(group.bind_forward(scope))
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return module._fsdp_group.post_forward(module, self._scopes.pop(), output)

    # -- torch's share_comm_ctx: reads one module's streams and assigns them to others ----

    @property
    def _comm_ctx(self) -> comm.DeviceStreams:
        return self._group.settings.streams

    @_comm_ctx.setter
    def _comm_ctx(self, streams: comm.DeviceStreams) -> None:
        self._group.configure(streams=streams)

    # -- what FSDP2's users and tests read ------------------------------------------------

    def _refuse_fsdp2_lazy_init(self) -> None:
        """Raises :class:`MixedFullyShardError` where FSDP2's lazy init reads the state:
        see [Note: torch's FSDPState and ours]."""
        torch_root = fsdp2_lazy_init_root(_TorchFSDPState)
        if torch_root is not None:
            raise mixed_error(torch_root, self._modules[0]())

    @property
    def _is_root(self) -> bool:
        self._refuse_fsdp2_lazy_init()  # its first read on torch 2.11 and 2.13
        return self._group.settings.is_root

    @_is_root.setter
    def _is_root(self, value: bool | None) -> None:
        raise mixed_error(None, self._modules[0]())

    @property
    def _modules_to_run_forward(self) -> set[nn.Module]:
        """The group's modules whose forward has not run yet in the current pass."""
        return self._group.modules_to_run_forward()

    def _lazy_init(self) -> None:
        """FSDP2's lazy-init checks: one root module, and no state under it initialized
        as a root before (the groups themselves are linked by the root's ``fully_shard``)."""
        if len(self._modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {[m() for m in self._modules]}")
        if self._lazy_initialized:
            return
        root = self._owner()
        for path, module in root.named_modules():
            state = state_of(module)
            if state is not None and state is not self and state._lazy_initialized:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {path}\n"
                    "FSDP requires running forward through the root module first")
        self._validate_no_duplicate_params()
        for module in root.modules():
            state = state_of(module)
            if state is not None:
                state._lazy_initialized = True

    def _validate_no_duplicate_params(self) -> None:
        """FSDP2's check of the root's lazy init: no parameter under this root was left
        by one ``fully_shard`` call to another's group (see [Note: shared parameters
        across groups]).

        Raises:
            ValueError: naming the first such parameter and the fix.
        """
        message = shared_param_error(self._owner())
        if message is not None:
            raise ValueError(message)

    # -- torch's pipeline stages: see [Note: pipeline schedules] ---------------------------

    @property
    def _state_ctx(self) -> _StateContext:
        self._refuse_fsdp2_lazy_init()  # its first read on torch 2.15
        return _StateContext(self._owner())

    @property
    def _fsdp_param_groups(self) -> list[_GroupView]:
        return [_GroupView(self._group)]

    @property
    def _fsdp_param_group(self) -> _GroupView:  # torch before the list
        return self._fsdp_param_groups[0]

    def _root_post_backward_final_callback(self) -> None:
        """Finishes the model's gradient reductions in flight (writing ``.grad``), as
        FSDP2's end-of-backward callback waits for its reduce-scatters."""
        self._group.finish_reductions()
