"""The compile tests use the fixtures of ``tests/conftest.py``."""

from tests.conftest import (  # noqa: F401
    fake_mesh,
    fake_world,
    inductor_cache,
    one_gloo_rank,
    run_inductor_cache_dir,
)
