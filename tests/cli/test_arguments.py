"""The commands' parser: every flag explained with its default, one spelling per flag,
and ``--help`` without torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_traceable.cli import arguments
from fsdp_traceable.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("demo", "train", "bench", "explain")
HELP_ARGVS = [["--help"], *([command, "--help"] for command in COMMANDS)]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def test_the_parser_builds_and_answers_help_without_torch() -> None:
    # The package's __init__ imports torch (it re-exports fully_shard), so the cli
    # package is loaded here under a bare parent package, with torch's import refused:
    # the parser and --help need nothing of torch.
    out = _run(f"""
        import contextlib, io, sys, types

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("the parser imported " + name)

        sys.meta_path.insert(0, NoTorch())
        package = types.ModuleType("fsdp_traceable")
        package.__path__ = [{str(ROOT / "fsdp_traceable")!r}]
        sys.modules["fsdp_traceable"] = package
        from fsdp_traceable.cli.main import main
        for argv in {HELP_ARGVS!r}:
            with contextlib.redirect_stdout(io.StringIO()) as help_text:
                try:
                    main(argv)
                except SystemExit as exit:
                    assert exit.code == 0, (argv, exit.code)
            assert "usage: fsdp-traceable" in help_text.getvalue(), argv
        print(sorted(m for m in sys.modules if m.startswith(("torch", "fsdp_traceable"))))
    """)
    assert eval(out) == ["fsdp_traceable", "fsdp_traceable.cli", "fsdp_traceable.cli.arguments",
                         "fsdp_traceable.cli.bench_output", "fsdp_traceable.cli.main",
                         "fsdp_traceable.cli.progress"]


@pytest.mark.xfail(strict=True, reason="fsdp_traceable/__init__.py imports torch (and "
                   "re-exports fully_shard) before python -m fsdp_traceable reaches the parser")
def test_python_m_fsdp_traceable_help_imports_no_torch() -> None:
    out = _run("""
        import runpy, sys
        sys.argv = ["fsdp_traceable", "train", "--help"]
        try:
            runpy.run_module("fsdp_traceable", run_name="__main__")
        except SystemExit:
            pass
        print("torch imported:", "torch" in sys.modules)
    """)
    assert "torch imported: False" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_text_and_shows_its_default(command: str) -> None:
    parser = _subcommands()[command]
    help_text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help text"
        if action.default is not None and action.default is not False:
            assert (f"(default: {action.default})" in help_text
                    or "default" in action.help), f"{command} {action.option_strings[0]}"


def test_bench_takes_its_modes_as_one_flag() -> None:
    options = {o for a in _subcommands()["bench"]._actions for o in a.option_strings}
    assert "--modes" in options and "--mode" not in options
    # bench runs its own modes and its own 1-D mesh: train's mode, step count and
    # parallelism flags would be ignored, so bench does not take them.
    assert not options & {"--steps", "--backend", "--tp", "--pp", "--hsdp"}
    assert "--modes" not in {o for a in _subcommands()["train"]._actions for o in a.option_strings}


def test_bench_modes_help_lists_every_mode() -> None:
    help_text = "".join(_subcommands()["bench"].format_help().split())
    assert all(mode in help_text for mode in arguments.BENCH_MODES)


def test_explain_defaults_are_the_demo_model() -> None:
    from fsdp_traceable.introspection.explain import DEMO_CONFIG

    assert (arguments.EXPLAIN_LAYERS, arguments.EXPLAIN_DIM, arguments.EXPLAIN_HEADS) == (
        DEMO_CONFIG.n_layers, DEMO_CONFIG.dim, DEMO_CONFIG.n_heads)


def test_train_args_defaults_are_the_flags_defaults() -> None:
    parsed = vars(build_parser().parse_args(["train"]))
    defaults = arguments.TrainArgs()
    assert {k: v for k, v in parsed.items() if k != "command"} == {
        k: getattr(defaults, k) for k in parsed if k != "command"}
