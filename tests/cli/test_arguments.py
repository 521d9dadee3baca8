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
COMMANDS = ("demo", "train", "bench", "explain", "plan")
HELP_ARGVS = [["--help"], *([command, "--help"] for command in COMMANDS)]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def test_the_parser_builds_and_answers_help_without_torch() -> None:
    # The cli package is loaded here under a bare parent package, with torch's import
    # refused: the parser and --help need nothing of torch themselves.
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


# The spellings of the command line: python -m with its flags around it, the package's
# __main__ named itself, and the installed script.
COMMAND_LINES = [
    ["-m", "fsdp_traceable", "--help"],
    ["-X", "importtime", "-mfsdp_traceable", "train", "--help"],
    ["-B", "-m", "fsdp_traceable.__main__", "bench", "--help"],
    *(["-m", "fsdp_traceable", command, "--help"] for command in ("demo", "explain")),
]


def _help_and_imports(argv: list[str]) -> tuple[str, list[str]]:
    """Runs ``python -X importtime *argv`` as a user starts it: its help text and every
    module the process imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    imported = [line.rpartition("|")[2].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]
    return result.stdout, imported


@pytest.mark.parametrize("command_line", COMMAND_LINES, ids=" ".join)
def test_python_m_fsdp_traceable_help_imports_no_torch(command_line: list[str]) -> None:
    # The package __init__ runs first (see [Note: the package import and the command line]).
    help_text, imported = _help_and_imports(command_line)
    assert "fsdp_traceable.cli.main" in imported and "usage: fsdp-traceable" in help_text
    assert not [name for name in imported if name.split(".")[0] in ("torch", "numpy")]


def test_the_installed_script_help_imports_no_torch() -> None:
    script = Path(sys.executable).with_name("fsdp-traceable")
    if not script.is_file():
        pytest.skip("the package is not installed in this interpreter's environment")
    help_text, imported = _help_and_imports([str(script), "--help"])
    assert "usage: fsdp-traceable" in help_text
    assert "fsdp_traceable" in imported and "torch" not in imported


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


def test_plan_args_defaults_are_the_flags_defaults() -> None:
    parsed = vars(build_parser().parse_args(["plan"]))
    defaults = arguments.PlanArgs()
    assert {k: v for k, v in parsed.items() if k != "command"} == {
        k: getattr(defaults, k) for k in parsed if k != "command"}
