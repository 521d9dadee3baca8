"""What one training step allocates and communicates, recorded op by op.

:class:`StepRecorder` is shown every aten op the step runs on plain (fake) tensors:
by :class:`RecordingFakeMode`, the fake mode a plan runs its step in, which sees also
the ops DTensor issues inside its own dispatch (a dispatch mode above DTensor sees a
DTensor op once, at its global shape); or as a ``TorchDispatchMode`` itself, for a
model without tensor subclasses in its compute. So it sees each storage the step
creates and each collective it issues:

- memory: every new storage of a plain (or fake) tensor is one allocation, freed when
  Python drops the storage (a weak reference's callback), as torch's ``MemTracker``
  counts; the running total and its peak are what the CPU allocator's counters would
  show for the same step;
- collectives: each c10d (eager ``fully_shard``) and functional (tensor parallel,
  traced) all-gather, reduce-scatter and all-reduce, with its buffer's bytes and the
  ranks of its group, attributed to the ``fully_shard`` group whose code issued it
  (read from the Python stack) or to the compute (tensor parallel);
- FLOPs: matmuls and attention by ``torch.utils.flop_counter``'s formulas.

[Note: plan memory categories]
Each allocation is labelled when it is made: by the phase the step is in (forward,
backward, optimizer, set by the caller with :meth:`StepRecorder.phase`) and by the
code that makes it: a ``fully_shard`` all-gather (unsharded parameters) or gradient
reduction (reduce-scatter buffers). Tensors alive before the step are parameters,
optimizer state or other persistent state. After the step the storages that became
the sharded gradients are relabelled as such. Activations are the tensors made in
forward that are still alive (at the start of backward: what autograd saved).
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["Allocation", "Collective", "RecordingFakeMode", "StepRecorder"]

PARAMS, OPTIMIZER, PERSISTENT = "parameters", "optimizer state", "other persistent"
GRADIENTS, UNSHARDED, REDUCTION = "gradients", "unsharded parameters", "gradient reduction"
ACTIVATIONS, BACKWARD, OPTIMIZER_TEMP = "activations", "backward temporaries", \
    "optimizer temporaries"
CATEGORIES = (PARAMS, OPTIMIZER, GRADIENTS, UNSHARDED, ACTIVATIONS, REDUCTION, BACKWARD,
              OPTIMIZER_TEMP, PERSISTENT)

_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)
# Collective ops -> kind; the output (all-gather) or input (reduce-scatter) is the
# unsharded buffer whose bytes a plan reports.
_COLLECTIVES = {
    "c10d._allgather_base_": "all-gather", "c10d.allgather_into_tensor_coalesced_": "all-gather",
    "c10d._reduce_scatter_base_": "reduce-scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce-scatter",
    "c10d.allreduce_": "all-reduce",
    "_c10d_functional.all_gather_into_tensor": "all-gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce-scatter",
    "_c10d_functional.all_reduce": "all-reduce",
    # Pipeline parallel's point-to-point transfers between stages.
    "c10d.send": "send", "c10d.recv_": "recv",
}
PIPELINE = "pipeline (send/recv)"
# The package's files whose frames mark who allocates (see [Note: plan memory categories]).
_GATHER_FILES = ("fsdp_traceable/fsdp/group_all_gather.py",
                 "fsdp_traceable/collectives/all_gather.py")
_REDUCE_FILES = ("fsdp_traceable/fsdp/gradient_reduction.py",
                 "fsdp_traceable/collectives/reduce.py")
_GROUP_FILE = "fsdp_traceable/fsdp/param_group.py"
_QUEUE_FILE = "fsdp_traceable/fsdp/reduce_queue.py"
_SHARDING_PROPAGATION = "torch/distributed/tensor/_sharding_prop.py"
_TENSOR_PARALLEL = "tensor parallel (compute)"


@dataclass
class Allocation:
    """One storage the step made (or found alive at its start)."""

    nbytes: int
    category: str
    op: str = ""  # the op that made it (for a reader of the record)


@dataclass(frozen=True)
class Collective:
    """One collective the step issued.

    Attributes:
        kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, or a pipeline's
            ``"send"`` / ``"recv"``.
        group: the ``fully_shard`` group (its module's path, ``""`` the root),
            ``"tensor parallel (compute)"`` or ``"pipeline (send/recv)"``.
        nbytes: the unsharded buffer: an all-gather's output, a reduce-scatter's input,
            an all-reduce's tensor, a send's or receive's tensor.
        ranks: the size of the process group it ran on.
        phase: the step's phase when it was issued.
    """

    kind: str
    group: str
    nbytes: int
    ranks: int
    phase: str


@dataclass
class StepRecorder(TorchDispatchMode):
    """Records a step's allocations and collectives (see the module docstring).

    Use :meth:`adopt` for the tensors alive before the step, then run the step under the
    recorder, marking phases with :meth:`phase`.
    """

    collectives: list[Collective] = field(default_factory=list)
    # Matmul and attention FLOPs of this rank, counted on plain tensors only: torch's
    # FlopCounterMode also counts a DTensor op at its global shape.
    flops: int = 0
    current: int = 0
    peak: int = 0
    _phase: str = "setup"
    _live: dict[int, tuple[weakref.ref, Allocation]] = field(default_factory=dict)
    # (+1 or -1, allocation) in order, to rebuild what was alive at any peak.
    _events: list[tuple[int, Allocation]] = field(default_factory=list)
    _event_phases: list[str] = field(default_factory=list)  # the phase of each event
    _peak_event: int = 0
    phase_peaks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _phase_peak_events: dict[str, int] = field(default_factory=dict)
    # (event index, phase) where each phase began: the plot's marks.
    phase_starts: list[tuple[int, str]] = field(default_factory=list)

    # id of a sharded parameter -> its fully_shard group's name: reductions the
    # model's queue finishes later (the last ones at the end of backward) run outside
    # their group's code, so the stack names them by their target's parameters.
    group_of_param: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def name_groups(self, model: torch.nn.Module) -> None:
        """Learns which ``fully_shard`` group each sharded parameter of ``model`` is in."""
        from ..fsdp.module_state import state_of

        for module in model.modules():
            state = state_of(module)
            if state is not None:
                for param in state.group.params.sharded_params:
                    self.group_of_param[id(param)] = state.group.name or "(root)"

    # -- memory -------------------------------------------------------------------------

    def adopt(self, tensors: Iterator[torch.Tensor], category: str) -> None:
        """Counts the storages of ``tensors`` (alive before the step) as ``category``."""
        for tensor in tensors:
            self._track(tensor, category)

    def relabel(self, tensors: Iterator[torch.Tensor], category: str) -> None:
        """Moves the storages of ``tensors`` (e.g. the sharded gradients) to ``category``."""
        for tensor in tensors:
            for local in _locals(tensor):
                entry = self._live.get(local.untyped_storage()._cdata)
                if entry is not None:
                    entry[1].category = category

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Labels what the body allocates and issues with phase ``name``."""
        previous, self._phase = self._phase, name
        self.phase_starts.append((len(self._events), name))
        try:
            yield
        finally:
            self._phase = previous

    def alive_at_peak(self, phase: str | None = None) -> Counter:
        """Bytes by category alive at the step's peak (or at ``phase``'s peak)."""
        by_category: Counter = Counter()
        for allocation in self.allocations_at_peak(phase):
            by_category[allocation.category] += allocation.nbytes
        return by_category

    def allocations_at_peak(self, phase: str | None = None) -> list[Allocation]:
        """The allocations alive at the step's peak (or at ``phase``'s peak)."""
        end = self._peak_event if phase is None else self._phase_peak_events.get(phase, 0)
        alive: dict[int, Allocation] = {}
        for sign, allocation in self._events[:end]:
            if sign > 0:
                alive[id(allocation)] = allocation
            else:
                alive.pop(id(allocation), None)
        return list(alive.values())

    def peaks_without(self, left_out: set[str]) -> dict[str, tuple[int, Counter]]:
        """Each phase's peak, and the bytes by category alive at it, counting no
        allocation whose (final) category is in ``left_out``: what stays on the device
        when those live on the host (CPU offload)."""
        current, peaks, ends = 0, {}, {}
        for index, (sign, allocation) in enumerate(self._events):
            if allocation.category in left_out:
                continue
            current += sign * allocation.nbytes
            phase = self._event_phases[index]
            if sign > 0 and current > peaks.get(phase, 0):
                peaks[phase], ends[phase] = current, index + 1
        result = {}
        for phase, end in ends.items():
            alive: dict[int, Allocation] = {}
            for sign, allocation in self._events[:end]:
                if allocation.category in left_out:
                    continue
                if sign > 0:
                    alive[id(allocation)] = allocation
                else:
                    alive.pop(id(allocation), None)
            by_category: Counter = Counter()
            for allocation in alive.values():
                by_category[allocation.category] += allocation.nbytes
            result[phase] = (peaks[phase], by_category)
        return result

    @property
    def event_phases(self) -> list[str]:
        """The phase of each point of :meth:`timeline`."""
        return list(self._event_phases)

    def most_alive(self, category: str) -> int:
        """The most bytes of ``category`` alive at once during the step."""
        current = most = 0
        for sign, allocation in self._events:
            if allocation.category == category:
                current += sign * allocation.nbytes
                most = max(most, current)
        return most

    def timeline(self, left_out: frozenset[str] = frozenset()) -> list[int]:
        """Bytes alive after each allocation and free, in order (``left_out``'s
        categories not counted)."""
        current, points = 0, []
        for sign, allocation in self._events:
            if allocation.category not in left_out:
                current += sign * allocation.nbytes
            points.append(current)
        return points

    def _track(self, tensor: torch.Tensor, category: str | None = None, op: str = "") -> None:
        for local in _locals(tensor):
            storage = local.untyped_storage()
            key = storage._cdata
            if key in self._live or storage.nbytes() == 0:
                continue
            allocation = Allocation(storage.nbytes(), category or self._category(), op)
            self._live[key] = (weakref.ref(storage, self._freed_callback(key, allocation)),
                               allocation)
            self._events.append((1, allocation))
            self._event_phases.append(self._phase)
            self.current += allocation.nbytes
            if self.current > self.peak:
                self.peak, self._peak_event = self.current, len(self._events)
            if self.current > self.phase_peaks[self._phase]:
                self.phase_peaks[self._phase] = self.current
                self._phase_peak_events[self._phase] = len(self._events)

    def _freed_callback(self, key: int, allocation: Allocation):
        def freed(_: weakref.ref) -> None:
            entry = self._live.get(key)
            if entry is not None and entry[1] is allocation:
                del self._live[key]
                self._events.append((-1, allocation))
                self._event_phases.append(self._phase)
                self.current -= allocation.nbytes
        return freed

    def _category(self) -> str:
        frame = sys._getframe(1)
        while frame is not None:
            filename = frame.f_code.co_filename.replace("\\", "/")
            if filename.endswith(_GATHER_FILES):
                return UNSHARDED
            if filename.endswith(_REDUCE_FILES):
                return REDUCTION
            frame = frame.f_back
        return {"forward": ACTIVATIONS, "backward": BACKWARD,
                "optimizer": OPTIMIZER_TEMP}.get(self._phase, PERSISTENT)

    # -- collectives --------------------------------------------------------------------

    def _record_collective(self, name: str, args: tuple, kwargs: dict, out: object) -> None:
        kind = _COLLECTIVES[name]
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        nbytes = max(t.numel() * t.element_size() for t in tensors)
        group = PIPELINE if kind in ("send", "recv") else _issuing_group(self.group_of_param)
        self.collectives.append(Collective(kind, group, nbytes, _group_size(args, kwargs),
                                           self._phase))

    def observe(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                out: object) -> None:
        """Counts one op's new storages, FLOPs and collective."""
        name = func._schema.name.replace("::", ".")
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None and all(
                type(t) in _PLAIN for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)):
            self.flops += counter(*args, **kwargs, out_val=out)
        if name in _COLLECTIVES:
            self._record_collective(name, args, kwargs, out)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and type(tensor) in _PLAIN:
                self._track(tensor, op=name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out


class RecordingFakeMode(FakeTensorMode):
    """A ``FakeTensorMode`` that shows every op it runs to its :attr:`recorder`.

    The fake mode is the bottom of the mode stack, so it runs every op on plain (fake)
    tensors, also those a tensor subclass such as DTensor issues inside its own
    dispatch, which a dispatch mode above the subclass never sees (it sees the DTensor
    op once, at its global shape).
    """

    recorder: StepRecorder | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if (self.recorder is not None and out is not NotImplemented
                and not _in_sharding_propagation()):
            self.recorder.observe(func, args, kwargs or {}, out)
        return out


def _in_sharding_propagation() -> bool:
    """Whether DTensor is running an op at its global shape only to learn its output's
    shape (``ShardingPropagator._propagate_tensor_meta_non_cached`` runs it in the
    active fake mode): no real step runs that op, so it is not recorded."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_SHARDING_PROPAGATION):
            return True
        frame = frame.f_back
    return False


def _locals(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data (a DTensor's local tensor)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return [local] if type(local) in _PLAIN else []


def _issuing_group(group_of_param: dict[int, str]) -> str:
    """The ``fully_shard`` group whose code is on the stack, or whose gradients the
    model's reduction queue is finishing, else the compute."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if filename.endswith(_GROUP_FILE):
            owner = frame.f_locals.get("self")
            if owner is not None and hasattr(owner, "name"):
                return owner.name or "(root)"
        if filename.endswith(_QUEUE_FILE):
            target = frame.f_locals.get("target")
            params = getattr(target, "params", None) or ()
            for param in params:
                if id(param) in group_of_param:
                    return group_of_param[id(param)]
        frame = frame.f_back
    return _TENSOR_PARALLEL


def _group_size(args: tuple, kwargs: dict) -> int:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, str):  # a functional collective's group name
            try:
                return dist.distributed_c10d._resolve_process_group(arg).size()
            except Exception:  # noqa: BLE001 - not a group name
                continue
        if isinstance(arg, torch._C.ScriptObject):  # a c10d op's ProcessGroup
            return dist.ProcessGroup.unbox(arg).size()
        if isinstance(arg, dist.ProcessGroup):
            return arg.size()
    return 1
