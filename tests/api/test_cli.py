"""The `elastron` command line: help, and one-line errors with a non-zero exit."""

import subprocess
import sys
from pathlib import Path

import pytest

from api.cli import main


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "train", "ckpt", "export"):
        assert cmd in out


def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model:\n  preset: giant\n")
    assert main(["train", str(cfg), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["elastron: error: model: unknown model preset 'giant'; choose one of "
                   "['125m', '1b', '8b', 'small', 'tiny']"]


def test_demo_rejects_nonsense_counts(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "the demo needs --steps >= 20 and --workers >= 3" in capsys.readouterr().err


def test_console_script_is_installed():
    # `pip install -e .` puts the console script next to the venv's interpreter.
    exe = Path(sys.executable).parent / "elastron"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: elastron" in r.stdout
