"""The README's quick start is what CI runs: keep the two in step."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```(?:bash|sh)?\n(.*?)```", readme, re.S)
    assert block, "README.md needs a '## Quick start' section with a code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_quick_start_has_two_commands_and_ci_runs_the_test_one():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    install_and_run, install_and_test = cmds
    assert "condinit init" in install_and_run
    assert "pytest" in install_and_test
    ci = (ROOT / ".ci" / "run").read_text()
    assert install_and_test in ci.splitlines(), "CI must run the README's test command verbatim"
