"""The compile tests use the fixtures of ``tests/conftest.py``."""

from tests.conftest import (  # noqa: F401
    fake_mesh,
    fake_world,
    fresh_inductor_cache,
    one_gloo_rank,
)
