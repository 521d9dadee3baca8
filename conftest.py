"""The fixtures of ``tests/`` and ``compile_tests/``, one set for the whole run, and the
order test files reach the workers in."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.fixtures"]

# The files that take longest (each 2-4 minutes of one worker on a 2-core machine, most of
# it compiling): they start first, so that no worker is left alone with one of them
# while the other has finished (`--dist loadfile` hands out files in collection order).
LONGEST_FILES = (
    "compile_tests/test_inductor_code.py",
    "compile_tests/test_block_compile.py",
    "tests/fsdp/test_compiled_parity.py",
    "tests/fsdp/test_fully_shard.py",
    "compile_tests/test_module_settings_compile.py",
    "tests/fsdp/test_fully_shard_arguments_parity.py",
    "compile_tests/test_recompiles.py",
    "compile_tests/test_all_gather_extensions_compile.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: every file keeps its own order
