"""The command line as a new user meets it: errors name the option and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandpool.cli import app


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_missing_task_file_names_the_option_and_the_fix(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nonexist.jsonl"
    res = CliRunner().invoke(app, [command, "--tasks", str(missing)])
    assert res.exit_code == 2
    text = " ".join(res.output.split())  # rich wraps long lines
    assert f"--tasks {missing}: no such file" in text
    assert "'default'" in text


@pytest.mark.parametrize("option", ["--rollouts", "--concurrency"])
def test_run_refuses_a_count_below_one(option: str) -> None:
    res = CliRunner().invoke(app, ["run", option, "0"])
    assert res.exit_code == 2
    assert option in res.output


def test_images_list_is_the_same_as_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDPOOL_HOME", str(tmp_path))
    plain, listed = CliRunner().invoke(app, ["images"]), CliRunner().invoke(app, ["images", "list"])
    assert plain.exit_code == 0 and listed.exit_code == 0, (plain.output, listed.output)
    assert listed.output == plain.output
    assert "0 images" in listed.output


def test_the_readme_python_example_runs_as_written(default_pack_path: Path, tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Use from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    exit_code, reward, ttfc = res.stdout.split()
    assert (exit_code, reward) == ("0", "0.0")  # the unfixed task: git status ok, not resolved
    assert float(ttfc) > 0
