"""Whether the package is being imported to run its own command line.

[Note: the package import and the command line]
``import fsdp_traceable`` imports torch and registers the ``torch.ops.fsdp_traceable``
ops (:mod:`.collectives.ops`), so a graph, a saved step or a user's code that names
those ops finds them after the plain import. Its public names (``fully_shard``,
``compile_step``, ...) are read from their modules on first use (the ``__init__``'s
``__getattr__``).

``python -m fsdp_traceable`` and the ``fsdp-traceable`` script import the package
``__init__`` before the command line's own code. There, the ``__init__`` imports
nothing of torch: ``--help`` and the argument errors answer without it, and each
command imports what it runs (every module that calls the ops imports
:mod:`.collectives`, which registers them). This module tells the two apart.

It imports nothing of the package and nothing of torch.
"""

from __future__ import annotations

import os
import sys

PACKAGE = __name__.rpartition(".")[0]
SCRIPT = "fsdp-traceable"  # [project.scripts] in pyproject.toml


def _python_m_target() -> str | None:
    """The module ``python -m`` is locating, or ``None`` outside that phase.

    While ``-m`` locates its module (importing the module's parent packages),
    ``sys.argv[0]`` is ``"-m"`` and ``sys.argv[1:]`` are the arguments after the module's
    name (documented for the ``-m`` option), so in ``sys.orig_argv`` the name is the
    token just before those: ``-m NAME`` or ``-mNAME`` (also after other flags, ``-BmNAME``).
    """
    original = getattr(sys, "orig_argv", None)
    if sys.argv[:1] != ["-m"] or not original or len(original) < len(sys.argv):
        return None
    token = original[len(original) - len(sys.argv)]
    if token.startswith("-"):
        flags, m, name = token[1:].partition("m")
        # Flags before "m" take no value of their own ("-X", "-W" and "-c" do).
        plain = flags.isalpha() and not set(flags) & set("XWc") or not flags
        return name if m and name and plain else None
    return token


def running_the_command_line() -> bool:
    """Whether this process runs the package's command line and is importing its
    ``__init__`` to get there (``python -m fsdp_traceable``, ``fsdp-traceable``).

    Returns:
        ``True`` there; ``False`` for every other import of the package.
    """
    if _python_m_target() in (PACKAGE, f"{PACKAGE}.__main__"):
        return True
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script in (SCRIPT, f"{SCRIPT}.exe", f"{SCRIPT}-script.py")
