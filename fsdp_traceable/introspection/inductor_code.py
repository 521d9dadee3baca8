"""Reads Inductor's generated Python wrapper code: its collectives and the kernels that
copy into and out of their buffers.

Inductor's output code (``run_and_get_code``, ``TORCH_LOGS=output_code``) runs a
``call`` function of one statement per line: kernel launches (``cpp_fused_*`` on CPU,
``triton_*`` on GPU), extern kernels (``extern_kernels.mm``), aten fallbacks, the
Triton copy ops (``torch.ops.fsdp_traceable_triton.*``, each one kernel launch) and the
functional collectives (``torch.ops._c10d_functional.*``). Buffers are named
``bufN``; a line ``bufA = reinterpret_tensor(bufB, ...)  # alias`` makes ``bufA`` a
view of ``bufB``, and ``bufA = bufB; del bufB  # reuse`` hands ``bufB``'s memory to a
new buffer. This module follows those names to attribute each kernel that touches a
collective's input or output buffer to that collective.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CollectiveCopies", "CollectiveOverlap", "Launch", "collective_kind",
           "collective_copies", "overlap", "schedule"]

_COLLECTIVE = re.compile(r"torch\.ops\._c10d_functional(?:_autograd)?\.(\w+)\.default\(")
_KERNEL = re.compile(r"^\s*((?:cpp_fused|triton)_\w+?)(?:\.run)?\(")
# aten fallbacks and the Triton copy ops (each launches one kernel of its own).
_EXTERN = re.compile(
    r"^\s*(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.(?:aten|fsdp_traceable_triton)\.\w+(?:\.\w+)?)\(")
# A call of a compiled nested region (its forward or backward subgraph).
_REGION = re.compile(r"^\s*(?:buf\d+ = )?(\w*subgraph\w*)\(")
_ASSIGNED = re.compile(r"^\s*(buf\d+) = ")
_ALIAS = re.compile(r"^\s*(buf\d+) = reinterpret_tensor\((buf\d+),.*# alias")
_REUSE = re.compile(r"^\s*(buf\d+) = .*# reuse")
_BUFFER = re.compile(r"\bbuf\d+\b")
_OUT_KWARG = re.compile(r"\bout=(buf\d+)")

# Functional collective op name -> kind.
_KINDS = (
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
    ("wait_tensor", "wait"),
)


def collective_kind(op_name: str) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``,
    ``"broadcast"`` or ``"wait"`` for a ``_c10d_functional`` op name (with or without
    namespace and overload, e.g. ``all_gather_into_tensor_out``); ``None`` otherwise.

    Args:
        op_name: an op name such as ``"_c10d_functional.wait_tensor.default"``.

    Returns:
        The collective kind, or ``None``.
    """
    for part in op_name.split("."):
        for prefix, kind in _KINDS:
            if part.startswith(prefix):
                return kind
    return None


@dataclass(frozen=True)
class Launch:
    """One statement of ``call``: a kernel launch, an extern call or a collective.

    ``kind`` is ``"kernel"``, ``"extern"``, ``"region"`` (a call of a compiled nested
    region), a collective kind or ``"wait"``; ``buffers`` the logical buffers (aliases
    and inline ``reinterpret_tensor`` views resolved) the statement names.
    """

    kind: str
    name: str
    line: int
    buffers: frozenset[str]
    output: str | None = None
    input: str | None = None


@dataclass
class CollectiveCopies:
    """One collective and the kernels that fill its input and read its output."""

    kind: str
    op: str
    line: int
    input_buffer: str
    output_buffer: str
    copy_in: list[str] = field(default_factory=list)
    copy_out: list[str] = field(default_factory=list)
    waited: bool = False


@dataclass
class CollectiveOverlap:
    """One collective and the compute issued between its start and its wait.

    ``compute``: the kernel launches and extern calls (matmuls, fallbacks) after the
    collective's statement and before the ``wait_tensor`` of its output, in program
    order: what the collective can overlap with. Empty when it is waited on at once
    (or never: ``wait_line`` is then ``None``).
    """

    kind: str
    op: str
    line: int
    compute: list[str] = field(default_factory=list)
    wait_line: int | None = None

    @property
    def waited(self) -> bool:
        """Whether the code waits for the collective."""
        return self.wait_line is not None


def _call_body(code: str) -> list[str]:
    start = code.find("def call(")
    if start < 0:
        return []
    lines = code[start:].splitlines()
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            break  # back at module level
        body.append(line)
    return body


def schedule(code: str) -> list[Launch]:
    """The launches of every ``call`` function in ``code``, in program order.

    Args:
        code: Inductor output code (one module, or several joined).

    Returns:
        One :class:`Launch` per kernel, extern call and collective statement.
    """
    launches: list[Launch] = []
    for part in code.split("def call(")[1:]:
        launches.extend(_schedule_one("def call(" + part))
    return launches


def _schedule_one(code: str) -> list[Launch]:
    base: dict[str, str] = {}  # alias -> the buffer it views
    generation: Counter = Counter()  # bumped when a name is reused for a new buffer

    def logical(name: str) -> str:
        name = base.get(name, name)
        return f"{name}#{generation[name]}" if generation[name] else name

    launches = []
    for number, line in enumerate(_call_body(code)):
        if line.lstrip().startswith("#"):
            continue
        if alias := _ALIAS.match(line):
            base[alias.group(1)] = base.get(alias.group(2), alias.group(2))
            continue
        if reuse := _REUSE.match(line):
            base.pop(reuse.group(1), None)
            generation[reuse.group(1)] += 1
            continue
        statement = line.split("  #", 1)[0]
        buffers = frozenset(logical(b) for b in _BUFFER.findall(statement))
        if collective := _COLLECTIVE.search(statement):
            op = collective.group(1)
            out = _OUT_KWARG.search(statement) or _ASSIGNED.match(statement)
            args = statement[collective.end():]
            first_arg = _BUFFER.search(_OUT_KWARG.sub("", args))
            launches.append(Launch(
                collective_kind(op) or op, op, number, buffers,
                output=logical(out.group(1)) if out else None,
                input=logical(first_arg.group(0)) if first_arg else None,
            ))
        elif kernel := _KERNEL.match(statement):
            launches.append(Launch("kernel", kernel.group(1), number, buffers))
        elif extern := _EXTERN.match(statement):
            launches.append(Launch("extern", extern.group(1), number, buffers))
        elif region := _REGION.match(statement):
            launches.append(Launch("region", region.group(1), number, buffers))
    return launches


def collective_copies(code: str) -> list[CollectiveCopies]:
    """Each collective in ``code`` with the kernels around it.

    ``copy_in``: the kernels (or fallback calls) before the collective that name its
    input buffer, i.e. write it. ``copy_out``: those after its ``wait_tensor`` that
    name its output buffer, i.e. read it. With one fused copy per bucket each list
    holds one kernel; that kernel may also compute other things Inductor fused into it.

    Args:
        code: Inductor output code.

    Returns:
        One :class:`CollectiveCopies` per non-wait collective, in program order.
    """
    results: list[CollectiveCopies] = []
    for launches, index, waited_at in _collectives(code):
        launch = launches[index]
        entry = CollectiveCopies(launch.kind, launch.name, launch.line,
                                 launch.input or "", launch.output or "")
        entry.copy_in = [
            before.name for before in launches[:index]
            if before.kind in ("kernel", "extern") and launch.input in before.buffers
        ]
        if waited_at is not None:
            entry.waited = True
            # Extern kernels (matmuls) reading the output directly are compute, not copies.
            entry.copy_out = [
                after.name for after in launches[waited_at + 1 :]
                if (after.kind == "kernel" or after.name.startswith("torch.ops.aten"))
                and launch.output in after.buffers
            ]
        results.append(entry)
    return results


def overlap(code: str) -> list[CollectiveOverlap]:
    """Each collective in ``code`` with the compute between its start and its wait.

    Args:
        code: Inductor output code.

    Returns:
        One :class:`CollectiveOverlap` per non-wait collective, in program order.
    """
    results: list[CollectiveOverlap] = []
    for launches, index, waited_at in _collectives(code):
        launch = launches[index]
        entry = CollectiveOverlap(launch.kind, launch.name, launch.line)
        if waited_at is not None:
            entry.wait_line = launches[waited_at].line
            entry.compute = [between.name for between in launches[index + 1 : waited_at]
                             if between.kind in ("kernel", "extern", "region")]
        results.append(entry)
    return results


def _collectives(code: str) -> Iterator[tuple[list[Launch], int, int | None]]:
    """Per non-wait collective of every ``call`` in ``code``: that call's launches, the
    collective's index in them and its wait's (``None`` if never waited)."""
    for part in code.split("def call(")[1:]:
        launches = _schedule_one("def call(" + part)
        for index, launch in enumerate(launches):
            if launch.kind in ("kernel", "extern", "region", "wait"):
                continue
            waited_at = next(
                (i for i, later in enumerate(launches[index + 1 :], index + 1)
                 if later.kind == "wait" and launch.output in later.buffers),
                None,
            )
            yield launches, index, waited_at
