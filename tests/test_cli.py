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


@pytest.mark.parametrize("command", ["run", "validate"])
def test_an_error_keeps_the_brackets_of_what_it_names(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "tasks[verified].jsonl"  # brackets rich would take for markup
    res = CliRunner().invoke(app, [command, "--tasks", str(missing)])
    assert res.exit_code == 2
    assert f"--tasks {missing}: no such file" in " ".join(res.output.split())


@pytest.mark.parametrize("option", ["--rollouts", "--concurrency"])
def test_run_refuses_a_count_below_one(option: str) -> None:
    res = CliRunner().invoke(app, ["run", option, "0"])
    assert res.exit_code == 2
    assert option in res.output


@pytest.mark.parametrize("option", ["--limit", "--retries"])
def test_run_refuses_a_negative_count(option: str, tmp_path: Path) -> None:
    # --limit -1 would slice off the last task; --retries -1 would mean none, silently.
    res = CliRunner().invoke(app, ["run", option, "-1", "--tasks", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2
    assert option in res.output and "no such file" not in res.output


def test_an_unknown_strategy_names_the_option_and_the_choices_before_any_work(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["run", "--strategy", "hot", "--tasks", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "--strategy hot: use cold, warm or reuse" in text and "no such file" not in text


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_directory_given_as_the_task_file_is_named_as_one(command: str, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, [command, "--tasks", str(tmp_path)])
    assert res.exit_code == 2
    assert f"{tmp_path}: a directory, not a task file" in " ".join(res.output.split())


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_task_file_without_rows_is_refused_not_run_as_zero_tasks(command: str, tmp_path: Path) -> None:
    empty = tmp_path / "tasks.jsonl"
    empty.write_text("\n\n")
    res = CliRunner().invoke(app, [command, "--tasks", str(empty), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert f"--tasks {empty}: the file holds no task rows" in " ".join(res.output.split())
    assert not (tmp_path / "out").exists()


def test_build_pack_prints_only_the_path_on_stdout(default_pack_path: Path) -> None:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "sandpool.cli", "build-pack"], capture_output=True,
                         text=True, timeout=600)  # usable as TASKS=$(sandpool build-pack)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == f"{default_pack_path}\n"


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--policy", "orcale", "--policy 'orcale' is not known: use oracle, noop or chat; did you mean 'oracle'?"),
    ("--backend", "kube", "--backend 'kube': use local or kubernetes"),
])
def test_a_bad_option_is_reported_before_the_task_pack_is_built(option: str, value: str, says: str) -> None:
    res = CliRunner().invoke(app, ["run", option, value])  # --tasks default: the pack, minutes on a first run
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert says in text and "task pack" not in text


def test_bench_simulate_without_its_extra_says_how_to_install_it_from_the_clone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for name in [m for m in sys.modules if m.startswith("sandpool.bench")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "simpy", None)  # as if not installed: import raises
    res = CliRunner().invoke(app, ["bench", "--simulate"])
    assert res.exit_code == 2
    assert "--simulate needs simpy: in sandpool's clone, pip install -e '.[sim]'" in res.output


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


def test_the_readme_snapshot_example_runs_as_written(default_pack_path: Path, tmp_path: Path) -> None:
    import re
    import subprocess
    import sys
    import textwrap

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Snapshots, forks"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(f"""import asyncio
from sandpool.core import SandboxPool
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.tasks import load_tasks

async def body(pool, task):
{textwrap.indent(code, "    ")}
    print(snap.content_hash == lease.restored_from.content_hash, len(kids), lease.restored_from is not None)

async def main():
    async with SandboxPool(LocalBackend(), strategy="reuse") as pool:
        await body(pool, load_tasks({str(default_pack_path)!r})[0])

asyncio.run(main())
""")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "4", "True"]
    assert (tmp_path / "step3.snap").is_file()


# Runs a command as a child subreaper (every orphan of its tree becomes ours), then reports
# what of that tree is still running once the command has exited, and kills it. Zombies are
# reaped first: a process whose parent was SIGKILLed (a sandbox's init when its bubblewrap
# is killed) is dead, not left running.
_SUBREAPER = """
import ctypes, json, os, signal, subprocess, sys
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
rc = subprocess.run(sys.argv[1:]).returncode
while True:
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            break
    except ChildProcessError:
        break
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        continue
    if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
        left.append(cmd)
        os.kill(int(pid), signal.SIGKILL)
print(json.dumps({"rc": rc, "left": left}))
"""


def test_a_run_without_a_terminal_logs_every_figure_and_leaves_no_process(
        default_pack_path: Path, tmp_path: Path) -> None:
    import json
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "sandpool.cli", "run", "--tasks", str(default_pack_path),
           "--limit", "1", "--rollouts", "2", "--concurrency", "1", "--no-validate",
           "--out", str(tmp_path)]
    res = subprocess.run([sys.executable, "-c", _SUBREAPER, *cmd], capture_output=True,
                         text=True, timeout=600)  # stderr is a pipe: no terminal
    end = json.loads(res.stdout.splitlines()[-1])
    assert end == {"rc": 0, "left": []}, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("rollouts")]
    assert lines[0] == "rollouts 0/2 (0%) 0:00:00"
    assert re.fullmatch(r"rollouts 2/2 \(100%\) \d+:\d\d:\d\d  completed (\d) {2}infra_failed (\d) "
                        r"{2}task_failed (\d) {2}rejected (\d)", lines[-1]), lines
    assert "…" not in res.stderr and "━" not in res.stderr
    paths = [str(tmp_path / f) for f in ("report.txt", "report.json", "rollouts.jsonl")]
    assert f"reports: {'  '.join(paths)}" in res.stderr.splitlines()  # not wrapped at 80 columns
