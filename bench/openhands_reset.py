"""In-place reset time of an agent-server sandbox, next to its baselines, one run.

Prints, for the calc test image on the local backend, the reset that ends each rollout:

* a sandbox without a service after the same commands (the baseline: the repo, /tmp and
  process checks every reset does);
* an agent-server sandbox after a rollout through ``SandpoolWorkspace``: a scripted OpenHands
  conversation whose terminal runs two commands, one ``execute_command``, and a conversation
  left on the server (its client never closed it). The reset also deletes the server's
  conversations and bash events and verifies its state directory; of that, the part spent
  in ``restore_service`` is printed on its own (absent on code without it);
* the alternative the reset avoids: starting a fresh agent-server sandbox (what restarting
  the server on every reset would cost at least).

    python bench/openhands_reset.py [--rounds 5]

It needs the SDK 1.58 venv (``nox -s openhands`` builds one) and root (bubblewrap overlays).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openhands.sdk import LLM, Agent, Conversation  # noqa: E402
from openhands.sdk.tool import Tool  # noqa: E402
from openhands.tools.file_editor import FileEditorTool  # noqa: E402
from openhands.tools.terminal import TerminalTool  # noqa: E402

from sandpool.core.backends.local import LocalBackend, LocalSandbox  # noqa: E402
from sandpool.core.paths import sandpool_home  # noqa: E402
from sandpool.core.pool import PoolLimits, SandboxPool  # noqa: E402
from sandpool.core.task import Task  # noqa: E402
from sandpool.integrations.openhands.server import agent_server_env, agent_server_service  # noqa: E402
from sandpool.integrations.openhands.workspace import SandpoolWorkspace  # noqa: E402
from tests.conftest import _build_calc_image  # noqa: E402

COMMANDS = ["echo work > /tmp/notes && git status --short", "python -c 'print(1)'"]


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:8.1f} ms  max {max(xs) * 1000:8.1f} ms  (n={len(xs)})"


def _agent() -> Agent:
    steps = [*({"tool": "terminal", "arguments": {"command": c}} for c in COMMANDS), {"text": "done"}]
    llm = LLM(model="sandpool_scripted/bench", usage_id="agent", native_tool_calling=True,
              litellm_extra_body={"sandpool_script": steps}, input_cost_per_token=0.0,
              output_cost_per_token=0.0)
    return Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)])


def _timed_restore(spent: list[float]) -> None:
    """Accumulate the time spent in LocalSandbox.restore_service, where it exists."""
    orig = getattr(LocalSandbox, "restore_service", None)
    if orig is None:
        return

    async def timed(self, **kw):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return await orig(self, **kw)
        finally:
            spent.append(time.monotonic() - t0)

    LocalSandbox.restore_service = timed  # type: ignore[method-assign]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    root = sandpool_home() / "test-images"
    commits = _build_calc_image(root)
    task = Task(instance_id="calc__bench", repo="sandpool/calc", base_commit=commits["buggy"],
                image="sandpool.test/calc:2", problem_statement="bench", FAIL_TO_PASS=["test_calc.py::test_add"])
    service = agent_server_service(agent_server_env(), preload=("sandpool_scripted_llm",),
                                   python_path=(str(ROOT / "tests" / "openhands" / "server_modules"),))
    spent: list[float] = []
    _timed_restore(spent)
    resets: dict[str, list[float]] = {"no service": [], "agent-server": []}
    limits = PoolLimits(create_timeout=900)

    async with SandboxPool(LocalBackend(root), strategy="reuse", limits=limits) as pool:
        await pool.prepare([task], concurrency=1)
        for _ in range(args.rounds):
            before = pool.counters.reset_total_s
            async with pool.claim(task) as lease:
                for c in COMMANDS:
                    await lease.exec(c)
            resets["no service"].append(pool.counters.reset_total_s - before)

    served = LocalBackend(root, service=service)
    async with SandboxPool(served, strategy="reuse", limits=limits) as pool:
        await pool.prepare([task], concurrency=1)

        def rollout() -> None:
            with SandpoolWorkspace(pool, task) as ws:
                conv = Conversation(agent=_agent(), workspace=ws, visualizer=None)
                conv.send_message("go")
                conv.run()  # left open: the server still holds it when the reset starts
                ws.execute_command("true")

        spent.clear()
        for _ in range(args.rounds):
            before = pool.counters.reset_total_s
            await asyncio.to_thread(rollout)
            resets["agent-server"].append(pool.counters.reset_total_s - before)
        quarantines = pool.counters.quarantines

    starts = []
    for _ in range(min(3, args.rounds)):
        t0 = time.monotonic()
        sb = await served.create(task.image)
        starts.append(time.monotonic() - t0)
        await served.delete(sb)
    await served.aclose()

    print("in-place reset at the end of a rollout (released to the pool)")
    for name, xs in resets.items():
        print(f"  {name:26s} {_ms(xs)}")
    if spent:
        print(f"  {'  of it restore_service':26s} {_ms(spent)}")
    else:
        print("  (this code has no restore_service: the server's state is neither reset nor checked)")
    print(f"  agent-server quarantines: {quarantines} of {args.rounds} resets")
    print("the alternative: a fresh agent-server sandbox (restarting the server per reset)")
    print(f"  {'create with agent-server':26s} {_ms(starts)}")


if __name__ == "__main__":
    asyncio.run(main())
