"""openhands-ai 1.11.0's app server with sandpool selected as its sandbox service.

Sandboxes are started, paused, resumed, searched and deleted through the app server's own
REST API; a conversation then runs on the ``AGENT_SERVER`` URL and session key the app server
reports, with the SDK the app server ships (1.34.0) and a scripted LLM loaded into the
agent-server. Deleting a sandbox ends the episode: sandpool grades it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
from openhands.sdk import LLM, Agent, Conversation
from openhands.sdk.tool import Tool
from openhands.sdk.workspace import RemoteWorkspace
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool

from sandpool.core.paths import sandpool_home
from tests.accountant_cases import KILL_MARK, Case, cases, expected, show


def agent_url(info: dict) -> str:
    (url,) = [u["url"] for u in info["exposed_urls"] if u["name"] == "AGENT_SERVER"]
    return url


def results(app_server) -> list[dict]:
    return [json.loads(line) for line in app_server.results.read_text().splitlines()] if app_server.results.exists() else []


def scripted_agent(steps: list[dict]) -> Agent:
    llm = LLM(model="sandpool_scripted/test", usage_id="agent", native_tool_calling=True,
              litellm_extra_body={"sandpool_script": steps})
    return Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)])


def converse(info: dict, workdir: str, steps: list[dict]) -> None:
    ws = RemoteWorkspace(host=agent_url(info), api_key=info["session_api_key"], working_dir=workdir)
    conv = Conversation(agent=scripted_agent(steps), workspace=ws, visualizer=None)
    try:
        conv.send_message("Fix the bug.")
        conv.run()
    finally:
        conv.close()
        ws.reset_client()


def test_app_server_runs_its_sandboxes_on_the_pool(app_server, calc_task):
    with app_server.api() as api:
        r = api.post("/sandboxes", params={"sandbox_spec_id": calc_task.instance_id})
        assert r.status_code == 200, r.text
        info = r.json()
        sid, url, key = info["id"], agent_url(info), info["session_api_key"]
        assert info["status"] == "RUNNING" and info["sandbox_spec_id"] == calc_task.instance_id
        assert url.startswith("http://127.0.0.1:") and key
        assert httpx.get(f"{url}/alive", timeout=30).status_code == 200
        # The relayed agent-server demands the sandbox's own session key.
        search = f"{url}/api/conversations/search"
        assert httpx.get(search, timeout=30).status_code == 401
        assert httpx.get(search, headers={"X-Session-API-Key": key}, timeout=30).status_code == 200
        assert [s["id"] for s in api.get("/sandboxes/search").json()["items"]] == [sid]

        assert api.post(f"/sandboxes/{sid}/pause").status_code == 200
        (paused,) = api.get("/sandboxes", params={"id": sid}).json()
        assert paused["status"] == "PAUSED" and not paused["exposed_urls"]
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 200
        (resumed,) = api.get("/sandboxes", params={"id": sid}).json()
        assert resumed["status"] == "RUNNING"
        assert httpx.get(f"{agent_url(resumed)}/alive", timeout=30).status_code == 200

        assert api.delete(f"/sandboxes/{sid}", params={"sandbox_id": sid}).status_code == 200
        assert api.get("/sandboxes/search").json()["items"] == []
        assert api.post("/sandboxes/unknown/pause").status_code == 404
    (rec,) = [r for r in results(app_server) if r["sandbox_id"] == sid]
    assert rec["outcome"] == "completed" and rec["reward"] == 0.0  # nothing was changed


def test_gold_patch_conversation_through_the_app_server_scores_one(app_server, calc_task):
    steps = [{"tool": "file_editor", "arguments": {"command": "create", "path": "/tmp/gold.patch",
                                                   "file_text": calc_task.patch}},
             {"tool": "terminal", "arguments": {"command": f"cd {calc_task.workdir} && git apply /tmp/gold.patch"}},
             {"text": "Applied the fix."}]
    with app_server.api() as api:
        info = api.post("/sandboxes", params={"sandbox_spec_id": calc_task.instance_id}).json()
        converse(info, calc_task.workdir, steps)
        assert api.delete(f"/sandboxes/{info['id']}", params={"sandbox_id": info["id"]}).status_code == 200
    (rec,) = [r for r in results(app_server) if r["sandbox_id"] == info["id"]]
    assert rec["outcome"] == "completed" and rec["reward"] == 1.0


def test_conversation_that_does_nothing_scores_zero(app_server, calc_task):
    with app_server.api() as api:
        info = api.post("/sandboxes", params={"sandbox_spec_id": calc_task.instance_id}).json()
        converse(info, calc_task.workdir, [{"text": "I give up."}])
        assert api.delete(f"/sandboxes/{info['id']}", params={"sandbox_id": info["id"]}).status_code == 200
    (rec,) = [r for r in results(app_server) if r["sandbox_id"] == info["id"]]
    assert rec["outcome"] == "completed" and rec["reward"] == 0.0


def kill_sandbox(info: dict, workdir: str) -> None:
    """SIGKILL the app server's sandbox ``info`` from the host, as an OOM kill would."""
    # Find it on the host by a file the agent-server writes into its repo (it lands in that
    # sandbox's overlay).
    marker = f"kill-me-{info['id']}"
    ws = RemoteWorkspace(host=agent_url(info), api_key=info["session_api_key"], working_dir=workdir)
    assert ws.execute_command(f"touch {marker}", cwd=workdir).exit_code == 0
    ws.reset_client()
    # The repo's upper layer: the first one (<state>/upper) or the fresh one each reset swaps
    # in (upper-0, upper-1), each under <state>/disk with a disk quota.
    (hit,) = [*sandpool_home().glob(f"local/*/sb-*/upper*/{marker}"),
              *sandpool_home().glob(f"local/*/sb-*/disk/upper*/{marker}")]
    state = next(p for p in hit.parents if p.name.startswith("sb-"))
    # Its bubblewrap's binds name the sandbox's public directory /run/sandpool/<run>/<sid>/.
    pids = subprocess.run(["pgrep", "-f", "--", f"bwrap .*/{state.name}/"], capture_output=True,
                          text=True).stdout.split()
    assert pids
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)


def test_a_sandbox_killed_before_delete_is_infra_not_reward_zero(app_server, calc_task):
    with app_server.api() as api:
        info = api.post("/sandboxes", params={"sandbox_spec_id": calc_task.instance_id}).json()
        kill_sandbox(info, calc_task.workdir)
        (got,) = api.get("/sandboxes", params={"id": info["id"]}).json()
        deadline = time.monotonic() + 60  # the pool notices the death when the agent's pipe closes
        while got["status"] != "ERROR" and time.monotonic() < deadline:
            time.sleep(0.05)
            (got,) = api.get("/sandboxes", params={"id": info["id"]}).json()
        assert got["status"] == "ERROR"
        assert api.delete(f"/sandboxes/{info['id']}", params={"sandbox_id": info["id"]}).status_code == 200
    (rec,) = [r for r in results(app_server) if r["sandbox_id"] == info["id"]]
    assert rec["outcome"] == "infra_failed" and rec["reward"] is None


def _app_episode(app_server, case: Case) -> tuple[str, float | None, str | None]:
    """One case as an app server client runs it: start a sandbox of its task, converse (the
    scripted LLM runs its commands in the terminal), delete the sandbox; returns the record
    the accountant appended. A command showing the kill mark ends the conversation, and the
    sandbox is killed from the host."""
    before = len(results(app_server))
    with app_server.api() as api:
        r = api.post("/sandboxes", params={"sandbox_spec_id": case.task.instance_id})
        if r.status_code == 200:  # else its claim failed: recorded as it ended
            info = r.json()
            commands = list(case.commands)
            killed = next((i for i, c in enumerate(commands) if KILL_MARK in c), None)
            steps = [{"tool": "terminal", "arguments": {"command": f"cd {case.task.workdir} && {c}"}}
                     for c in commands[:None if killed is None else killed + 1]]
            converse(info, case.task.workdir, [*steps, {"text": "done"}])
            if killed is not None:
                kill_sandbox(info, case.task.workdir)
            assert api.delete(f"/sandboxes/{info['id']}", params={"sandbox_id": info["id"]}).status_code == 200
    (rec,) = results(app_server)[before:]
    assert rec["task_id"] == case.task.instance_id
    return rec["outcome"], rec["reward"], rec["error_kind"]


def test_the_app_server_gives_the_one_outcome_table(app_server, calc_task):
    all_cases = cases(calc_task)
    got = {case.name: _app_episode(app_server, case) for case in all_cases}
    show("OpenHands app server (openhands-ai sandbox service)", got)
    assert got == expected(all_cases)
