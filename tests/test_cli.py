"""fusedmoe demo: runs, checks itself, and refuses bad arguments clearly."""

import subprocess
import sys

import pytest

from fusedmoe.tools.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--tokens", "16"],
        ["demo", "--preset", "deepseek-v3", "--tokens", "7", "--dtype", "float32", "--scale", "32"],
        ["demo", "--preset", "gpt-oss-120b", "--tokens", "1", "--scale", "32"],
        ["demo", "--tokens", "0"],
    ],
)
def test_demo_runs_and_reports(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "rel_err" in out and "tokens/s" in out
    assert "torch" in out


def test_demo_says_it_scaled_down(capsys):
    assert main(["demo", "--tokens", "4"]) == 0
    assert "divided by 16, rounded up to a multiple of 32" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--backend", "nope"], "unknown backend"),
        (["demo", "--tokens", "-1"], "--tokens"),
        (["demo", "--scale", "0"], "--scale"),
    ],
)
def test_demo_refuses_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_hf_demo_generates_the_same_tokens(capsys):
    pytest.importorskip("transformers")
    assert main(["demo", "--hf", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical tokens: True" in out and "patched 2 MoE blocks" in out


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "fusedmoe", "demo", "--tokens", "3", "--scale", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "rel_err" in result.stdout


def test_import_does_not_need_triton_or_gpu():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import fusedmoe\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(fusedmoe.available_backends())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout


def test_help_says_what_the_tool_is_for(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Mixture-of-Experts" in out and "argument parsing" not in out
