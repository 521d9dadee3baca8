"""The compile tests use the fixtures of ``tests/conftest.py``."""

from tests.conftest import fake_mesh, fake_world, fresh_inductor_cache  # noqa: F401
