"""``explain`` from the command line: what it says, and that it leaves Dynamo's
caching warnings alone."""

from __future__ import annotations

import warnings

import torch._dynamo.utils

from fsdp_traceable.cli.main import main


def test_explain_says_what_it_compiles_and_warns_nothing(capsys, monkeypatch) -> None:
    # warn_once keeps each message once per process: start with none kept.
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["explain", "--layers", "1", "--dim", "16", "--steps", "1",
                     "--aot-eager"]) == 0
    out, err = capsys.readouterr()
    assert "Frames compiled" in out
    assert "compiling 1 train step(s) on 2 fake ranks (AOTAutograd only)" in err
    # Turning the caches off with force_disable_caches made Dynamo warn that it had
    # turned off its profile-guided dynamic shapes too.
    assert not [w for w in caught if "force_disable_caches" in str(w.message)]
