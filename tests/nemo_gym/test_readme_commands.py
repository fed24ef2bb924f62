"""The READMEs' own commands, run as written from a copy of this clone.

``examples/nemo_gym/README.md``'s ``bash`` blocks under "Install" and "Run" are extracted and
run in one shell, in document order, from the root of a copy of the committed tree (``HEAD``): ``make nemo-gym-venv`` makes a venv with sandpool installed from the copy and builds the
wheel NeMo Gym's per-server venv installs, then ``ng_run`` starts with the shipped config (and
NeMo Gym builds that venv with uv from ``requirements.txt``). Once the server answers, one oracle episode goes through
the routes the README lists, then the shell gets the Ctrl-C a user would send.

The main README's ``pip install`` lines are run too, each in a fresh venv at the copy's root.
These tests take minutes (a venv, NeMo Gym's dependencies and the default task pack's warm
pools); they run in ``nox -s nemo_gym-0.4``, whose Python 3.12 is what the README names.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym.config_types import BaseServerConfig
from nemo_gym.global_config import DEFAULT_HEAD_SERVER_PORT
from nemo_gym.server_utils import (
    GlobalAIOHTTPAsyncClientConfig,
    ServerClient,
    is_global_aiohttp_client_setup,
    set_global_aiohttp_client,
)
from sandpool.core.task import Task
from tests.nemo_gym.conftest import MAIN, SimpleAgentEpisode, wait_for_servers, row_for

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def readme_blocks(readme: Path, *sections: str) -> list[str]:
    """Return the ``bash`` fenced blocks under the ``## <section>`` headings, in document order.

    Raises:
        AssertionError: A section is missing or holds no bash block (the README changed shape).
    """
    text = readme.read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    found = []
    for section in sections:
        [body] = [p for p in parts if p.split("\n", 1)[0].strip() == section] or [None]
        assert body is not None, f"{readme.name} has no '## {section}' section"
        blocks = _FENCE.findall(body)
        assert blocks, f"{readme.name} '## {section}' has no bash block"
        found += blocks
    return found


def inline_pip_installs(readme: Path) -> list[str]:
    """Return the README's inline ``pip install ...`` code spans."""
    return re.findall(r"`(pip install [^`]+)`", readme.read_text())


def fresh_clone(dest: Path) -> Path:
    """Put the repository's committed tree (``HEAD``, symlinks kept) at ``dest``, as a clone has it."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no test venv on PATH, no NeMo Gym settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NEMO_GYM_", "VIRTUAL_ENV", "PYTEST_", "UV_"))}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = ":".join(p for p in env.get("PATH", "/usr/bin:/bin").split(":") if p != venv_bin)
    return env


@pytest.mark.timeout(600)
def test_main_readme_install_lines_install_from_the_clone(tmp_path: Path) -> None:
    clone = fresh_clone(tmp_path / "clone")
    lines = inline_pip_installs(clone / "README.md")
    assert len(lines) >= 2, lines  # the nemo-gym and kubernetes extras
    for i, line in enumerate(lines):
        venv = tmp_path / f"venv{i}"
        # The lines presume an active Python 3.12 venv; this test's own interpreter is one.
        script = f"{sys.executable} -m venv {venv} && source {venv}/bin/activate && {line} && python -c 'import sandpool'"
        res = subprocess.run(["bash", "-e", "-c", script], cwd=clone, env=user_env(),
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{line!r} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"


@pytest.mark.timeout(1800)
async def test_nemo_gym_readme_install_and_run_serve_an_episode(tmp_path: Path, pack_tasks: list[Task]) -> None:
    clone = fresh_clone(tmp_path / "clone")
    script = "\n".join(readme_blocks(clone / "examples" / "nemo_gym" / "README.md", "Install", "Run"))
    assert "ng_run" in script
    log_path = tmp_path / "readme.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=clone, env=user_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = BaseServerConfig(host="127.0.0.1", port=DEFAULT_HEAD_SERVER_PORT)
    try:
        await asyncio.to_thread(wait_for_servers, proc, head, [MAIN], log_path, 1500.0)
        if not is_global_aiohttp_client_setup():  # as the server_client fixture does
            set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
        client = await asyncio.to_thread(ServerClient.load_from_global_config, head)
        task = pack_tasks[0]  # the shipped config serves the default task pack
        ep = SimpleAgentEpisode(client, MAIN, row_for(task))
        seeded = await ep.seed()
        assert seeded["instance_id"] == task.instance_id
        status, body = await ep.tool("write_file", path="/tmp/gold.patch", content=task.patch)
        assert status == 200, body
        status, body = await ep.tool("shell", command="git apply /tmp/gold.patch")
        assert status == 200 and body["exit_code"] == 0, body
        result = await ep.verify()
        assert result["reward"] == 1.0 and result["resolved"] is True, result
        # NeMo Gym built the server's venv itself, from requirements.txt, with sandpool's wheel.
        built = clone / "examples" / "nemo_gym" / "resources_servers" / "sandpool_swe" / ".venv"
        assert list(built.glob("lib/python3.12/site-packages/sandpool-*.dist-info")), log_path.read_text()[-3000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the user's shell
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
