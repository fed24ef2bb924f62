"""N tasks through OpenHands on a sandpool pool: rewards and TTFC.

The OpenHands agent loop runs here (openhands-sdk 1.58); its ``terminal`` and ``file_editor``
tools run in pooled bubblewrap sandboxes; each episode ends with sandpool's grader, and an
infra failure is reported as such, never as reward 0. Without ``--model`` the LLM is
OpenHands' own scripted ``TestLLM`` playing an oracle on even rollouts (the gold patch, written
with the file editor and applied with ``git apply``) and a no-op on odd ones, so the example
runs without a model server; with ``--model`` (and ``--base-url``) it calls that model.

    make venv && .venv/bin/nox -s openhands_example -- [-n 8] [--concurrency 4] \
        [--tasks tasks.jsonl] [--model openai/qwen --base-url http://127.0.0.1:8000/v1]

The nox session runs it in a venv with openhands-sdk/-tools 1.58 (Python 3.12, built on first
use under ``~/.cache/sandpool/venvs``, the one ``nox -s openhands`` tests with) and this
checkout on ``PYTHONPATH``; any such venv works the same way. Without ``--tasks`` it uses the
default task pack (built on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from openhands.sdk import LLM  # noqa: E402
from openhands.sdk.llm import Message, MessageToolCall, TextContent  # noqa: E402
from openhands.sdk.testing import TestLLM  # noqa: E402

from sandpool.core.backends.local import LocalBackend  # noqa: E402
from sandpool.core.metrics import Workload  # noqa: E402
from sandpool.core.pool import Lease, SandboxPool  # noqa: E402
from sandpool.core.rollout import run_rollout  # noqa: E402
from sandpool.envs.scoring import default_grader  # noqa: E402
from sandpool.envs.tasks import load_tasks  # noqa: E402
from sandpool.integrations.openhands import openhands_episode  # noqa: E402


def scripted_llm(lease: Lease, rollout: int) -> LLM:
    """OpenHands' TestLLM: the gold patch on even rollouts, nothing on odd ones."""
    if rollout % 2:
        return TestLLM.from_messages([Message(role="assistant", content=[TextContent(text="No change.")])])

    def call(i: int, name: str, args: str) -> Message:
        return Message(role="assistant", content=[TextContent(text="")],
                       tool_calls=[MessageToolCall(id=f"c{i}", name=name, arguments=args, origin="completion")])

    import json

    patch = json.dumps({"command": "create", "path": "/tmp/gold.patch", "file_text": lease.task.patch})
    apply = json.dumps({"command": f"cd {lease.workdir} && git apply /tmp/gold.patch"})
    return TestLLM.from_messages([call(1, "file_editor", patch), call(2, "terminal", apply),
                                  Message(role="assistant", content=[TextContent(text="Applied the fix.")])])


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=8, help="rollouts to run (tasks are cycled)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tasks", type=Path, help="tasks.jsonl (default: the default task pack)")
    ap.add_argument("--images-root", type=Path, help="local image directory root")
    ap.add_argument("--model", help="a litellm model name; default: the scripted TestLLM")
    ap.add_argument("--base-url", help="the model server's URL (e.g. a local vLLM)")
    args = ap.parse_args()

    if args.tasks is None:
        from sandpool.envs.taskpack import abuild_default_pack

        args.tasks = await abuild_default_pack()
    tasks = load_tasks(args.tasks)
    picked = [tasks[i % len(tasks)] for i in range(args.n)]

    async with SandboxPool(LocalBackend(args.images_root), strategy="reuse") as pool:
        await pool.prepare(picked, concurrency=args.concurrency)
        sem = asyncio.Semaphore(args.concurrency)
        grader = default_grader()
        t0 = time.monotonic()

        async def one(i: int):  # type: ignore[no-untyped-def]
            def make_llm(lease: Lease) -> LLM:
                if args.model:
                    return LLM(model=args.model, base_url=args.base_url, usage_id="agent")
                return scripted_llm(lease, i)

            async with sem:
                return await run_rollout(pool, picked[i], openhands_episode(make_llm), grader=grader,
                                         rollout=i, policy=args.model or ("oracle" if i % 2 == 0 else "noop"))

        results = await asyncio.gather(*(one(i) for i in range(args.n)))
        wall = time.monotonic() - t0
        for r in results:
            ttfc = f"{r.ttfc_s * 1000:7.1f} ms" if r.ttfc_s is not None else "      -"
            print(f"{r.task_id:40s} {r.policy:8s} {r.outcome.value:13s} reward={r.reward} ttfc={ttfc}")
        report = pool.report(Workload(tasks=len({t.instance_id for t in picked}), images=len({t.image for t in picked}),
                                      rollouts=args.n, concurrency=args.concurrency, backend="local",
                                      strategy="reuse"), list(results), wall)
        t = report.ttfc
        print(f"\nTTFC over {t.n} rollouts: mean {t.mean_s * 1000:.1f} ms, p50 {t.p50_s * 1000:.1f} ms, "
              f"p95 {t.p95_s * 1000:.1f} ms, p99 {t.p99_s * 1000:.1f} ms, max {t.max_s * 1000:.1f} ms")
        print(f"outcomes: {report.failures}; mean reward {report.reward.mean}; wall {wall:.1f} s")


if __name__ == "__main__":
    asyncio.run(main())
