"""The fixtures of ``tests/`` and ``compile_tests/``, one set for the whole run."""

pytest_plugins = ["tests.fixtures"]
