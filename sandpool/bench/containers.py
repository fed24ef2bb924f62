"""The Docker baselines: a container per rollout, as the SWE-bench harness runs one.

* ``docker-run``: each rollout creates its container (``tail -f /dev/null``, as swebench
  4.1.0's ``build_container``), starts it and runs its first command; TTFC runs from the
  create request to that command's result.
* ``docker-exec``: a container started ahead of each rollout (each lane starts its next
  rollout's container while the current rollout runs, and its first before the run starts,
  as a warm pool is filled); TTFC runs from taking the container to the first result.

Both run the workload of :mod:`sandpool.bench.workload` with the harness's own calls: commands
by ``exec_run`` (no shell unless the command needs one), the gold patch copied in with
``put_archive`` (swebench's ``copy_to_container``), and grading as the task's harness grades
(:func:`sandpool.envs.grading.harness.plan_for`: its prelude, the test files reset from
``base_commit``, the test patch, its test command, its log parser and its score) in the same
container. The container is then removed with force: a kill, no grace period (the harness's
``stop(timeout=15)`` waits out the grace period on a ``tail -f /dev/null`` that ignores SIGTERM,
which would measure the grace period, not Docker). Containers get sandpool's limits: no
network, the same CPU quota, memory and pid limits.

The docker SDK is synchronous, so lanes run in threads, one per lane, as swebench's
``run_threadpool`` runs instances.
"""

from __future__ import annotations

import io
import shlex
import tarfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sandpool.bench.workload import FIRST_COMMAND, Probes
from sandpool.core.base import ResourceLimits
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.reset import SAFE_GIT
from sandpool.core.strategies import get_strategy
from sandpool.core.task import Task
from sandpool.envs.grading.harness import TestPlan, plan_for

__all__ = ["MODES", "run_containers"]

MODES = ("docker-run", "docker-exec")


def _archive(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _grade_script(task: Task, plan: TestPlan, timeout: float) -> str:
    base = shlex.quote(task.base_commit)
    lines = [f"cd {shlex.quote(task.workdir)}", *plan.prelude]
    for f in plan.restore:  # the harness's reset: files at base_commit only
        q = shlex.quote(f)
        lines.append(f"if {SAFE_GIT} cat-file -e {base}:{q} 2>/dev/null; then "
                     f"{SAFE_GIT} checkout -q {base} -- {q}; fi")
    if plan.test_patch:
        lines.append(f"{SAFE_GIT} apply -v /tmp/test.patch")
    lines.append(f"timeout {int(timeout)} bash -c {shlex.quote(plan.command)} 2>&1")
    return "\n".join(lines)


class _Run:
    """One mode's run: its client, counters and samples, shared by its lanes' threads."""

    def __init__(self, client: Any, mode: str, limits: ResourceLimits, grade_timeout: float) -> None:
        self.client, self.mode, self.limits, self.grade_timeout = client, mode, limits, grade_timeout
        self.results: list[RolloutResult] = []
        self.probes = Probes()
        self.created = 0
        self._lock = threading.Lock()

    def start(self, image: str) -> Any:
        """Create and start a container of ``image``, as swebench's harness does."""
        c = self.client.containers.create(
            image, command="tail -f /dev/null", detach=True, user="root", network_mode="none",
            nano_cpus=int(self.limits.cpus * 1e9), mem_limit=self.limits.memory_bytes,
            pids_limit=self.limits.pids)
        with self._lock:
            self.created += 1
        c.start()
        return c

    def rollout(self, task: Task, i: int, container: Any | Future, t_claim: float) -> RolloutResult:
        """Run rollout ``i`` of ``task`` on ``container`` (or the one ``container`` will give);
        remove the container after."""
        c, ttfc = None, None
        try:
            c = container.result() if isinstance(container, Future) else container
            t0 = time.monotonic()
            first = c.exec_run(FIRST_COMMAND, workdir=task.workdir)
            ttfc, t1 = time.monotonic() - t_claim, time.monotonic()
            if first.exit_code != 0:
                raise RuntimeError(f"first command exited {first.exit_code}: {first.output[-300:]!r}")
            c.exec_run(FIRST_COMMAND, workdir=task.workdir)
            with self._lock:
                self.probes.add(ttfc, t1 - t0, time.monotonic() - t1)
            c.exec_run("git status --short", workdir=task.workdir)  # what both policies run first
            policy = "oracle" if i % 2 == 0 else "noop"
            if policy == "oracle":
                c.put_archive("/tmp", _archive("gold.patch", task.patch.encode()))
                applied = c.exec_run("git apply --whitespace=nowarn /tmp/gold.patch", workdir=task.workdir)
                if applied.exit_code != 0:
                    return self._done(RolloutResult(task_id=task.instance_id, rollout=i, policy=policy,
                                                    outcome=Outcome.TASK_FAILED, reward=0.0, ttfc_s=ttfc,
                                                    error="gold patch did not apply"))
            plan = plan_for(task)
            if plan.test_patch:
                c.put_archive("/tmp", _archive("test.patch", plan.test_patch.encode()))
            log = c.exec_run(["bash", "-c", _grade_script(task, plan, self.grade_timeout)],
                             workdir=task.workdir).output.decode("utf-8", "replace")
            resolved, _, _ = plan.score(plan.parse(log))
            return self._done(RolloutResult(task_id=task.instance_id, rollout=i, policy=policy,
                                            outcome=Outcome.COMPLETED, reward=float(resolved),
                                            ttfc_s=ttfc, duration_s=time.monotonic() - t_claim))
        except Exception as exc:  # noqa: BLE001 - every Docker failure is this baseline's infra failure
            return self._done(RolloutResult(task_id=task.instance_id, rollout=i, outcome=Outcome.INFRA_FAILED,
                                            ttfc_s=ttfc, error_kind=type(exc).__name__, error=str(exc)[-500:]))
        finally:
            if c is not None:
                try:
                    c.remove(force=True, v=True)
                except Exception:  # noqa: BLE001, S110 - the daemon's stop removes what is left
                    pass

    def _done(self, r: RolloutResult) -> RolloutResult:
        self.results.append(r)
        return r


def run_containers(client: Any, mode: str, tasks: list[Task], *, rollouts: int, concurrency: int,
                   limits: ResourceLimits = ResourceLimits(), grade_timeout: float = 300.0,
                   ) -> tuple[list[RolloutResult], Probes, int, float]:
    """Run every task ``rollouts`` times in containers, ``concurrency`` at once; blocking.

    Lanes are laid out as sandpool's runner lays them out (the strategy's split of the
    concurrency over images, each lane running its rollouts back to back).

    Args:
        client: A docker SDK client.
        mode: ``docker-run`` or ``docker-exec``.
        tasks: The tasks (their images are in the daemon).
        rollouts: Rollouts per task.
        concurrency: Rollouts at once.
        limits: Per-container limits (sandpool's sandbox limits).
        grade_timeout: Seconds the test command may run.

    Returns:
        ``(results, the workload's probes, containers created, wall seconds)``.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    run = _Run(client, mode, limits, grade_timeout)
    by_image: dict[str, list[tuple[Task, int]]] = {}
    for t in tasks:
        by_image.setdefault(t.image, []).extend((t, i) for i in range(rollouts))
    slots = get_strategy("cold").plan({k: len(v) for k, v in by_image.items()}, concurrency)
    lanes: list[tuple[str, deque[tuple[Task, int]]]] = []
    for image, items in by_image.items():  # each lane owns its share, so it can start ahead
        n = slots.get(image, 1)
        lanes += [(image, deque(items[j::n])) for j in range(n)]
    ahead = ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="docker-ahead")
    first: dict[int, Future] = {}
    t0 = time.monotonic()
    if mode == "docker-exec":  # the first containers start before the run, as a warm pool fills
        first = {j: ahead.submit(run.start, image) for j, (image, _) in enumerate(lanes)}
        for f in first.values():
            f.exception()

    def lane(j: int, image: str, queue: deque[tuple[Task, int]]) -> None:
        nxt: Future | None = first.get(j)
        while queue:
            task, i = queue.popleft()
            if mode == "docker-run":
                t_claim = time.monotonic()
                run.rollout(task, i, run.start(image), t_claim)
                continue
            t_claim = time.monotonic()
            mine, nxt = nxt, (ahead.submit(run.start, image) if queue else None)
            assert mine is not None
            run.rollout(task, i, mine, t_claim)

    try:
        with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="docker-lane") as pool:
            for f in [pool.submit(lane, j, image, q) for j, (image, q) in enumerate(lanes)]:
                f.result()
    finally:
        ahead.shutdown(wait=True)
    return run.results, run.probes, run.created, time.monotonic() - t0
