"""The benchmark's workload: which tasks, and what every rollout does, the same on every side.

Every rollout, whatever runs it (a sandpool strategy or a Docker container):

1. runs :data:`FIRST_COMMAND`, a bare command, in the task's workdir: TTFC ends when its result
   is back, so TTFC measures the sandbox, not the work of a command;
2. runs it again at once: one bare exec round trip in a sandbox already claimed, under the
   load of the same run (the physical limit of TTFC: no claim makes the first command return
   sooner than a command in a sandbox already held);
3. rollout ``i`` of a task acts as the oracle when ``i`` is even (writes the gold patch to
   ``/tmp/gold.patch`` and applies it with ``git apply``) and as the no-op policy when odd;
4. runs ``git status --short`` (what the pack's policies run first), and is graded: by sandpool's grading on sandpool's side, by the harness's own test command and
   log parser in the container on Docker's.

Tasks (``--tasks``): ``oci`` (the SWE-bench-shaped OCI test image of
:mod:`sandpool.envs.taskpack.oci` under one name per task, as SWE-bench has one image per
task with shared layers), ``default`` (the default task pack; image directories, so no Docker
strategy), or a task file whose images are in the local image store.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sandpool.core import errors
from sandpool.core.images import ImageStore, hydrate
from sandpool.core.pool import Lease
from sandpool.core.task import Task
from sandpool.envs.policies import NoopPolicy, OraclePolicy, Policy

__all__ = ["FIRST_COMMAND", "BenchTasks", "Probed", "Probes", "load_bench_tasks", "oci_tasks", "policies"]

#: The first command of every rollout: bare, so its own work adds nothing to TTFC.
FIRST_COMMAND = "true"


class BenchTasks:
    """The tasks of a benchmark and where their images are.

    Attributes:
        tasks: The tasks, spread over their images.
        spec: What ``--tasks`` said.
        store: The OCI image store holding their images (None for image directories).
    """

    def __init__(self, tasks: list[Task], spec: str, store: ImageStore | None) -> None:
        self.tasks, self.spec, self.store = tasks, spec, store

    @property
    def images(self) -> list[str]:
        """The distinct images, in task order."""
        return list(dict.fromkeys(t.image for t in self.tasks))

    def oci_source(self, image: str) -> tuple[str, str]:
        """``(skopeo source, manifest digest)`` an image was hydrated from, to load it elsewhere.

        Raises:
            ConfigError: The tasks' images are image directories, not OCI images.
        """
        img = self.store.resolve(image) if self.store is not None else None
        if img is None:
            raise errors.ConfigError(
                f"--tasks {self.spec}: image {image!r} is not an OCI image in the local store, so "
                "Docker cannot run it; use --tasks oci, or tasks whose images were pulled with "
                "'sandpool images pull'")
        return img.source, img.digest


def _spread(tasks: list[Task], n: int) -> list[Task]:
    """Pick ``n`` tasks round-robin across images, so every image is in the workload."""
    by: dict[str, list[Task]] = {}
    for t in tasks:
        by.setdefault(t.image, []).append(t)
    out, i = [], 0
    while len(out) < n and any(by.values()):
        queue = list(by.values())[i % len(by)]
        if queue:
            out.append(queue.pop(0))
        i += 1
    return out


def oci_tasks(n: int, store: ImageStore) -> list[Task]:
    """``n`` tasks on the SWE-bench-shaped OCI test image, each under its own image name (the
    same layers), hydrated into ``store`` if missing. Builds the test image on first use."""
    from sandpool.envs.taskpack.oci import VERSION, build_test_images

    root = build_test_images()
    base = json.loads((root / "swe-task.json").read_text())
    tasks = []
    for i in range(n):
        name = f"sandpool.bench/swe-calc-{i}:v{VERSION}"  # new test images, new names
        if store.resolve(name) is None:
            hydrate(f"oci:{root / 'layout'}:swe", name=name, store=store)
        tasks.append(Task.model_validate({**base, "instance_id": f"sandpool__calc-{i}", "image": name}))
    return tasks


async def load_bench_tasks(spec: str, limit: int) -> BenchTasks:
    """The tasks ``--tasks spec`` names, at most ``limit`` (spread over their images).

    Raises:
        ConfigError: ``limit`` is below 1.
        FileNotFoundError: ``spec`` is neither ``oci``, ``default`` nor an existing file.
    """
    import asyncio

    from sandpool.envs.tasks import load_tasks

    if limit < 1:
        raise errors.ConfigError(f"--limit {limit}: give at least 1 task")
    if spec == "oci":
        store = ImageStore()
        return BenchTasks(await asyncio.to_thread(oci_tasks, limit, store), spec, store)
    if spec == "default":
        from sandpool.envs.taskpack import abuild_default_pack

        return BenchTasks(_spread(load_tasks(await abuild_default_pack()), limit), spec, None)
    if not Path(spec).is_file():
        raise FileNotFoundError(f"--tasks {spec}: no such file; give 'oci', 'default' or a task file")
    return BenchTasks(_spread(load_tasks(spec), limit), spec, ImageStore())


def policies() -> list[Policy]:
    """Rollout ``i`` uses ``policies()[i % 2]``: the oracle, then the no-op policy."""
    return [OraclePolicy(), NoopPolicy()]


class Probes:
    """What steps 1 and 2 of the workload measure, one sample per rollout, in seconds.

    TTFC is ``claim + first``: the claim's part (from the claim request until the first
    command is sent) and the first command's own round trip.

    Attributes:
        claim: TTFC less the first command's round trip.
        first: The first command's round trip.
        round_trip: The second command's round trip (the physical limit of TTFC).
    """

    def __init__(self) -> None:
        self.claim: list[float] = []
        self.first: list[float] = []
        self.round_trip: list[float] = []

    def add(self, ttfc: float, first: float, round_trip: float) -> None:
        """Record one rollout's TTFC, first command and second command (seconds)."""
        first = min(first, ttfc)  # timed around the call: never more than the TTFC it ends
        self.claim.append(ttfc - first)
        self.first.append(first)
        self.round_trip.append(round_trip)


class Probed(Policy):
    """A policy whose episode starts with steps 1 and 2 of the workload (see the module docstring).

    Args:
        inner: The policy that acts after them.
        probes: Receives each rollout's samples.
    """

    def __init__(self, inner: Policy, probes: Probes) -> None:
        self.inner, self.probes = inner, probes
        self.name = inner.name

    async def act(self, lease: Lease, task: Task) -> None:
        t0 = time.monotonic()
        await lease.exec(FIRST_COMMAND, timeout=60)
        t1 = time.monotonic()
        await lease.exec(FIRST_COMMAND, timeout=60)
        assert lease.ttfc_s is not None
        self.probes.add(lease.ttfc_s, t1 - t0, time.monotonic() - t1)
        await self.inner.act(lease, task)
