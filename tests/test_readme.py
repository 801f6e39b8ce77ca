"""The README's two set-up commands are the ones CI and users run; its fine-tuning example
runs and trains."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if not line.startswith("#")]


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("fusedmoe demo")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_fine_tuning_example_runs_and_the_loss_goes_down():
    pytest.importorskip("transformers", minversion="5")
    [code] = re.findall(r"```python\n(.*?)```", _section("Fine-tuning"), flags=re.S)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md (Fine-tuning)", "exec"), {"__name__": "readme"})
    losses = [float(x) for x in re.findall(r"loss (\S+)", printed.getvalue())]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.1, printed.getvalue()
