"""The collectives demo runs on local gloo ranks and checks itself against the reference."""

import pytest

from fsdp_traceable.cli.demo import run_demo

pytestmark = pytest.mark.gloo


def test_demo_runs_and_matches_reference(capfd) -> None:
    run_demo(2)
    out = capfd.readouterr().out
    assert "all-gather and reduce match the reference" in out
    assert out.count("equals the full parameters: True") == 2


def test_demo_rejects_empty_world() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_demo(0)
