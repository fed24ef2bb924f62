"""What a Kubernetes burst samples beside its rollouts: the API server's request counters
(:func:`scrape_apiserver`) and, every few seconds, this machine's CPU, load and memory,
etcd's size and the measured namespace's pods by phase (:class:`Monitor`)."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["Monitor", "scrape_apiserver"]

_METRIC = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$")


async def scrape_apiserver(admin) -> tuple[Counter, int, float]:
    """apiserver requests by verb, pods created (POST pods 201), etcd size seen (bytes), from
    the apiserver's ``/metrics`` as ``admin`` (a KubernetesBackend) may read it."""
    http = await admin._client()
    async with http.session.get(http.url("/metrics"), headers=await http.headers()) as resp:
        text = await resp.text()
    by_verb: Counter = Counter()
    pods, db = 0, 0.0
    for line in text.splitlines():
        if not (mm := _METRIC.match(line)):
            continue
        name, value = mm.group("name"), float(mm.group("value"))
        if name == "apiserver_storage_size_bytes":
            db = max(db, value)
        if name != "apiserver_request_total":
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', mm.group("labels")))
        by_verb[labels.get("verb", "?")] += int(value)
        if (labels.get("verb"), labels.get("resource"), labels.get("subresource"),
                labels.get("code")) == ("POST", "pods", "", "201"):
            pods += int(value)
    return by_verb, pods, db


class Monitor:
    """Samples every ``period`` s: this machine's CPU busy, load and memory, etcd's size, and
    the pods of the namespaces being measured, by phase."""

    def __init__(self, admin, period: float = 2.0) -> None:
        self.admin, self.period = admin, period
        self.samples: list[dict[str, Any]] = []
        self.namespace: str | None = None
        self._task: asyncio.Task | None = None

    @staticmethod
    def _cpu() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[3] + f[4]

    async def _run(self) -> None:
        t0, i0 = self._cpu()
        while True:
            await asyncio.sleep(self.period)
            t1, i1 = self._cpu()
            busy, (t0, i0) = 1 - (i1 - i0) / max(1, t1 - t0), (t1, i1)
            mem = {k: int(v.split()[0]) * 1024 for k, v in
                   (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
                   if k in ("MemTotal", "MemAvailable")}
            s: dict[str, Any] = {"t": time.time(), "cpu_busy": busy, "load1": os.getloadavg()[0],
                                 "mem_used_gb": (mem["MemTotal"] - mem["MemAvailable"]) / 1e9}
            try:
                s["etcd_db_mb"] = (await scrape_apiserver(self.admin))[2] / 1e6
                if self.namespace:
                    http = await self.admin._client()
                    pods = await http.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")
                    phases = Counter(p.get("status", {}).get("phase", "?") for p in pods.get("items", []))
                    s["pods"] = dict(phases)
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                pass
            self.samples.append(s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def window(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [x for x in self.samples if t0 <= x["t"] <= t1]

    def peaks(self, t0: float, t1: float) -> dict[str, float]:
        s = self.window(t0, t1)
        if not s:
            return {}
        return {"cpu busy mean": round(sum(x["cpu_busy"] for x in s) / len(s), 2),
                "load 1m max": round(max(x["load1"] for x in s), 1),
                "memory used max (GB)": round(max(x["mem_used_gb"] for x in s), 1),
                "etcd db max (MB)": round(max(x.get("etcd_db_mb", 0) for x in s), 1)}
