import subprocess
import sys

from typer.testing import CliRunner

from arborl.cli import app


def test_help_lists_commands():
    out = CliRunner().invoke(app, ["--help"])
    assert out.exit_code == 0 and "bench" in out.output


def test_unknown_benchmark_is_a_clear_error():
    out = CliRunner().invoke(app, ["bench", "nope"])
    assert out.exit_code == 2 and "unknown benchmark" in out.output


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "arborl.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "bench" in out.stdout
