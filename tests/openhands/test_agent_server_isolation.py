"""One rollout on an agent-server sandbox must not leave anything the next rollout there can see.

The policy's commands run in the sandbox as the same user as the OpenHands agent-server (its
terminals are the server's children), so rollout 1 here plants what a cheating policy would:
files in the server's state directory and ``$HOME``, a conversation and bash events left on the
server, processes, terminal and tmux state, reads and writes of the server's memory, a
stopped or killed server. Rollout 2 claims the pool's only sandbox again and looks for any of
it through the sandbox, the server's own terminal and its API. Either it sees nothing, on the
same sandbox reset in place, or the reset quarantined the sandbox and rollout 2 runs on a
fresh one: a dirty sandbox is never silently reused.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from openhands.sdk import Conversation
from openhands.sdk.event import MessageEvent, ObservationEvent

from sandpool.core import errors
from sandpool.core.backends.local import SERVICE_DIR, LocalBackend
from sandpool.core.classify import Verdict, classify
from sandpool.core.pool import PoolLimits, SandboxPool
from sandpool.integrations.openhands.server import agent_server_service
from sandpool.integrations.openhands.workspace import SandpoolWorkspace
from tests.openhands.test_agent_server import SERVER_MODULES, scripted_agent, server_env  # noqa: F401

# Finds the agent-server's pid inside the sandbox (its command line names its app).
SERVER_PID = "$(pgrep -f openhands.agent_server.api | head -1)"


@pytest.fixture(scope="module")
async def one_sandbox_pool(test_images_root, calc_commits, calc_task, server_env):  # noqa: F811
    """A pool holding one agent-server sandbox: rollout 2 gets rollout 1's unless it was quarantined."""
    service = agent_server_service(server_env, preload=("sandpool_scripted_llm",),
                                   python_path=(str(SERVER_MODULES),))
    backend = LocalBackend(test_images_root, service=service)
    limits = PoolLimits(max_live=1, create_timeout=900, claim_timeout=900)
    async with SandboxPool(backend, strategy="reuse", limits=limits) as pool:
        await pool.prepare([calc_task], concurrency=1)
        yield pool


def converse(ws: SandpoolWorkspace, steps: list[dict], *, close: bool = True) -> list[str]:
    """Run a scripted conversation on the workspace's agent-server; return what its tools and
    the agent said (terminal outputs, final message). ``close=False`` leaves it on the server,
    as a client that crashed would (closing deletes it)."""
    conv = Conversation(agent=scripted_agent([*steps, {"text": "done"}]), workspace=ws, visualizer=None)
    try:
        conv.send_message("go")
        conv.run()
        out = []
        for event in conv.state.events:
            if isinstance(event, ObservationEvent):
                out.append(event.observation.text)
            elif isinstance(event, MessageEvent) and event.source == "agent":
                out.extend(c.text for c in event.llm_message.content if hasattr(c, "text"))
        return out
    finally:
        if close:
            conv.close()


def terminal(*commands: str) -> list[dict]:
    return [{"tool": "terminal", "arguments": {"command": c}} for c in commands]


def look_for(ws: SandpoolWorkspace, mark: str) -> str:
    """Everything rollout 2 can see that could carry ``mark``, as one text."""
    lease = ws.lease
    # The marker reaches the sandbox through the environment only: no command line holds it.
    seen = [ws._run(lease.exec(
        f'grep -rs "$M" {SERVICE_DIR} /tmp ~ /testbed; ls -laR {SERVICE_DIR} /tmp; ps -eo args',
        env={"M": mark}, timeout=60)).text]
    api = ws.client
    seen.append(api.get("/api/conversations/search").text)
    seen.append(api.get("/api/bash/bash_events/search").text)
    seen += converse(ws, terminal(
        'echo "leak=$LEAK"; tmux show-environment -g LEAK 2>&1; alias; python3 -c "print(1)"',
        "ps -eo args; ls -la ~"))
    return "\n".join(seen)


def two_rollouts(pool: SandboxPool, task, plant) -> tuple[str, str, str, int]:
    """Rollout 1 runs ``plant(ws, mark)``; rollout 2 looks. Returns (sandbox 1, sandbox 2,
    what rollout 2 saw, quarantines in between)."""
    mark = f"sandpool-leak-{uuid.uuid4().hex}"
    q0 = pool.counters.quarantines
    with SandpoolWorkspace(pool, task) as ws:
        first = ws.lease.id
        plant(ws, mark)
    with SandpoolWorkspace(pool, task) as ws:
        second = ws.lease.id
        seen = look_for(ws, mark)
    assert mark not in seen, f"rollout 2 saw rollout 1's {mark}:\n{_around(seen, mark)}"
    quarantined = pool.counters.quarantines - q0
    # Reused only when its reset passed; a replacement only after a quarantine.
    assert (second == first) == (quarantined == 0), (first, second, pool.counters.quarantine_reasons)
    return first, second, seen, quarantined


def _around(text: str, mark: str) -> str:
    i = text.index(mark)
    return text[max(0, i - 300):i + 300]


async def test_a_conversation_and_bash_events_left_on_the_server_are_gone_and_the_sandbox_is_reused(
        one_sandbox_pool, calc_task):
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        # An honest rollout whose client crashed: a conversation never closed (so never
        # deleted) and a command through the server's bash API, both carrying the task's data.
        out = converse(ws, terminal(f"echo {mark} > /tmp/notes; cat /tmp/notes"), close=False)
        assert any(mark in o for o in out)
        assert mark in ws.execute_command(f"echo {mark}").stdout
        assert ws.client.get("/api/conversations/count").json() == 1

    _, _, seen, quarantined = await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)
    assert quarantined == 0  # the reset itself cleans the server: an honest rollout costs no restart
    assert '"items":[]' in seen.replace(" ", "")  # rollout 1's conversation is not listed


async def test_files_planted_in_the_server_state_dir_and_home_do_not_reach_the_next_rollout(
        one_sandbox_pool, calc_task):
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        conv_dir = f"{SERVICE_DIR}/workspace/conversations/{uuid.uuid4().hex}"
        files = {
            # A conversation the server would list (and load) as its own.
            f"{conv_dir}/base_state.json": json.dumps({"id": mark}),
            # Config and persisted settings the server reads, a module on a path it might import.
            f"{SERVICE_DIR}/workspace/openhands_agent_server_config.json": json.dumps({"note": mark}),
            f"{SERVICE_DIR}/workspace/.openhands/settings.json": json.dumps({"note": mark}),
            f"{SERVICE_DIR}/sitecustomize.py": f"print({mark!r})\n",
            f"{SERVICE_DIR}/tmux/tmux-1000/{mark}": mark,
            f"{SERVICE_DIR}/tmux/tmux-1000/.openhands-socket-creation.lock": mark,
            # $HOME: the server's terminals read these (bash, tmux, python, git).
            "/tmp/.bashrc": f"export LEAK={mark}\nalias ls='echo {mark}'\n",
            "/tmp/.tmux.conf": f"set-environment -g LEAK {mark}\n",
            "/tmp/.local/lib/python3.12/site-packages/usercustomize.py": f"print({mark!r})\n",
            "/tmp/.openhands/skills/leak/SKILL.md": f"---\nname: leak\n---\n{mark}\n",
            "/tmp/.gitconfig": f"[alias]\n\tleak = !echo {mark}\n",
        }
        for path, text in files.items():
            ws._run(ws.lease.write_file(path, text.encode()))
        res = ws._run(ws.lease.exec(f"ln -s /tmp/.bashrc {SERVICE_DIR}/workspace/link; "
                                    f"mkfifo {SERVICE_DIR}/fifo; chmod 777 {SERVICE_DIR}/workspace"))
        assert res.ok, res.err_text

    await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)


async def test_processes_and_terminal_state_left_by_a_rollout_do_not_reach_the_next_rollout(
        one_sandbox_pool, calc_task):
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        # Through the server's own terminal: its children, its tmux server.
        converse(ws, terminal(
            f"export LEAK={mark}; tmux set-environment -g LEAK {mark}",
            f"(setsid sh -c 'exec -a {mark} sleep 1000' &); nohup sh -c 'exec -a {mark} sleep 1000' &"))
        # Beside it: a tmux server of its own in the server's tmux directory, a daemon.
        res = ws._run(ws.lease.exec(
            f"TMUX_TMPDIR={SERVICE_DIR}/tmux tmux new-session -d -s {mark} 'sleep 1000' && "
            f"(setsid sh -c 'exec -a {mark} sleep 1000' > /dev/null 2>&1 &)"))
        assert res.ok, res.err_text

    await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)


# Run as the policy inside the sandbox: every way a same-uid process reaches into another.
_REACH_IN = r"""
import ctypes, os, sys
pid = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
results = {}
for name, mode in (("environ", "rb"), ("mem", "r+b"), ("maps", "rb")):
    try:
        with open(f"/proc/{pid}/{name}", mode) as f:
            f.read(16)
        results[name] = "opened"
    except OSError as exc:
        results[name] = exc.errno
try:  # its open files (the socket, its log): listing names numbers only, opening is the reach
    fds = os.listdir(f"/proc/{pid}/fd")
    results["fd"] = [os.readlink(f"/proc/{pid}/fd/{n}") for n in fds] or "none"
except OSError as exc:
    results["fd"] = exc.errno
results["ptrace"] = ctypes.get_errno() if libc.ptrace(16, pid, 0, 0) != 0 else "attached"  # PTRACE_ATTACH
results["seize"] = ctypes.get_errno() if libc.ptrace(0x4206, pid, 0, 0) != 0 else "seized"  # PTRACE_SEIZE
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = iovec(ctypes.addressof(buf), 8), iovec(0x400000, 8)
n = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
results["vm_write"] = ctypes.get_errno() if n < 0 else "wrote"
caps = [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1]
results["cap_eff"] = caps
print(results)
"""


async def test_the_policy_cannot_read_or_write_the_server_process(one_sandbox_pool, calc_task):
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        # The session key is the server's only secret: the policy must not read it.
        key = ws.api_key
        ws._run(ws.lease.write_file("/tmp/reach_in.py", _REACH_IN.encode()))
        res = ws._run(ws.lease.exec(f"python3 /tmp/reach_in.py {SERVER_PID}; "
                                    f"grep -rsa {key} /proc/*/environ {SERVICE_DIR} /tmp; true"))
        assert key not in res.text, res.text
        found = eval(res.text.strip().splitlines()[0])  # noqa: S307 - our own script's dict
        # EACCES (13) or EPERM (1): no capability inside, and the server is not dumpable.
        assert found["cap_eff"] == "0000000000000000"
        assert all(found[k] in (1, 13) for k in ("environ", "mem", "fd", "ptrace", "seize", "vm_write")), found

    await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)


async def test_the_server_imports_nothing_from_where_the_policy_writes(one_sandbox_pool, calc_task):
    # A module planted wherever the policy can write, then looked up by the server process
    # itself (the scripted LLM runs there): the server must not find it.
    name = f"sandpool_planted_{uuid.uuid4().hex}"

    def plant_and_probe() -> list[str]:
        with SandpoolWorkspace(one_sandbox_pool, calc_task) as ws:
            for d in (SERVICE_DIR, f"{SERVICE_DIR}/workspace", "/tmp", "/testbed", "/dev/shm"):
                ws._run(ws.lease.write_file(f"{d}/{name}.py", b"raise SystemExit('planted code ran')\n"))
            return converse(ws, [{"probe": "find_spec", "name": name}])

    said = await asyncio.to_thread(plant_and_probe)
    assert said == ["null"], said


@pytest.mark.parametrize("signal", ["STOP", "KILL", "TERM", "INT", "HUP", "USR1", "TSTP"])
async def test_a_signalled_server_serves_the_next_rollout_or_its_sandbox_is_quarantined(one_sandbox_pool, calc_task, signal):
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        res = ws._run(ws.lease.exec(f"kill -{signal} {SERVER_PID}"))
        assert res.ok, res.err_text

    first, second, _, quarantined = await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)
    # look_for held a conversation in rollout 2: its server answered either way.
    if signal in ("STOP", "KILL"):  # cannot be caught: the reset finds the server stopped or gone
        assert quarantined == 1 and first != second
        assert "service" in one_sandbox_pool.counters.quarantine_reasons[-1]
    else:  # caught and ignored: the same server serves the next rollout
        assert quarantined == 0 and first == second


async def test_priority_set_on_the_server_quarantines_its_sandbox(one_sandbox_pool, calc_task):
    # Same uid, no ptrace needed; the server's terminals (rollout 2's commands) would inherit it.
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        res = ws._run(ws.lease.exec(f"renice -n 19 -p {SERVER_PID}"))
        assert res.ok, res.err_text

    first, second, _, quarantined = await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)
    assert quarantined == 1 and first != second
    assert "resource limits" in one_sandbox_pool.counters.quarantine_reasons[-1]


async def test_the_policy_cannot_set_the_limits_of_the_server_or_the_agent(one_sandbox_pool, calc_task):
    # The kernel lets a process set the limits of any process of its uid, and the server's
    # terminals (rollout 2's commands) would inherit them: the backend's seccomp filter refuses
    # prlimit on any process but the caller, so the server runs on as it started and its
    # sandbox is reused.
    def plant(ws: SandpoolWorkspace, mark: str) -> None:
        def sh(command: str):  # type: ignore[no-untyped-def]
            return ws._run(ws.lease.exec(command, timeout=60))

        server = sh(f"echo {SERVER_PID}").text.strip()
        assert "agent.py" in sh("tr '\\0' ' ' < /proc/1/cmdline").text  # the sandbox's agent
        # Both run as the policy's uid: a refusal is the filter's, not the kernel's uid check.
        uids = sh(f"awk '/^Uid:/ {{print $2}}' /proc/{server}/status /proc/1/status").text.split()
        assert uids == [sh("id -u").text.strip()] * 2, uids
        before = sh(f"cat /proc/{server}/limits").text
        for pid in (server, "1"):
            res = sh(f"prlimit --pid {pid} --fsize=4096:4096 --nofile=3:3")
            assert res.exit_code == 1 and "Operation not permitted" in res.err_text, (pid, res)
        assert sh(f"cat /proc/{server}/limits").text == before
        # Its own limits the policy still sets (the filter refuses only another process's).
        assert sh("ulimit -f 8 && ulimit -f").text.strip() == "8"

    first, second, _, quarantined = await asyncio.to_thread(two_rollouts, one_sandbox_pool, calc_task, plant)
    assert quarantined == 0 and first == second


async def test_a_policy_that_kills_its_server_mid_conversation_fails_the_task_not_infra(one_sandbox_pool, calc_task):
    # Through the server's own terminal, as the LLM would: OpenHands' client then loses the
    # server as if the network had failed. Scored as the policy's, or a policy learns to turn
    # each rollout it is failing into a retried infra failure.
    def episode() -> None:
        with SandpoolWorkspace(one_sandbox_pool, calc_task) as ws:
            conv = Conversation(agent=scripted_agent([*terminal(f"kill -9 {SERVER_PID}"), {"text": "done"}]),
                                workspace=ws, visualizer=None)
            try:
                conv.send_message("go")
                conv.run(timeout=120)  # the client retries a lost server until this timeout
            finally:
                conv.close()

    with pytest.raises(errors.ServiceKilled) as info:
        await asyncio.to_thread(episode)
    assert classify(info.value) is Verdict.POLICY and "gone" in str(info.value)
