"""The seed's image conditions on kwok nodes: large images, small disks, shared bandwidth.

Used by ``provisioner.py`` when ``up --image-model=seed`` (see README.md, "Image model"):

* every image has a size drawn once from ``min_gb + lognormal(median_gb - min_gb, sigma)``
  GB, seeded by the image name (the same image has the same size on every node, in every run);
* every node has ``disk_gb`` of image disk; an image pulled there is cached, the least
  recently used images that no pod on the node uses are evicted to make room (an image in
  use is never evicted; if the disk holds only images in use, the node overcommits and the
  overcommit is counted);
* a pull takes ``size / share`` where the node's ``bandwidth_mbps`` (MB/s) is shared equally
  by the pulls in flight on it (processor sharing, re-balanced every ``tick_s``); a pod of an
  image being pulled on its node waits for that pull.

State changes are appended to ``<run>/image-model.jsonl`` (one JSON object per line, wall
time): pulls and pods in flight per node, pulls done, evictions. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

GB = 1e9
MB = 1e6

DEFAULTS = {
    "min_gb": 1.2,
    "median_gb": 2.5,
    "sigma": 0.6,
    "disk_gb": 100.0,
    "bandwidth_mbps": 400.0,
    "tick_s": 0.05,
}


def image_size(image: str, p: dict[str, float]) -> float:
    """Bytes of ``image``: ``min + lognormal`` drawn from a generator seeded by its name."""
    seed = int.from_bytes(hashlib.sha256(image.encode()).digest()[:8], "big")
    rng = random.Random(seed)
    extra = max(p["median_gb"] - p["min_gb"], 0.01)
    return (p["min_gb"] + rng.lognormvariate(math.log(extra), p["sigma"])) * GB


class _Node:
    def __init__(self) -> None:
        self.cache: OrderedDict[str, float] = OrderedDict()  # image -> bytes, LRU first
        self.in_use: Counter[str] = Counter()
        self.pulls: dict[str, list[Any]] = {}  # image -> [bytes left, started, [callbacks]]
        self.used = 0.0
        self.pods = 0


class ImageModel:
    """Per-node image caches and pulls; thread-safe.

    Args:
        params: ``DEFAULTS`` overridden by the cluster's ``image_model`` config.
        log_path: Where state changes are appended (JSON lines), or None.
    """

    def __init__(self, params: dict[str, float], log_path: Path | None) -> None:
        self.p = {**DEFAULTS, **params}
        self.disk = self.p["disk_gb"] * GB
        self.bw = self.p["bandwidth_mbps"] * MB
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        self._log = log_path.open("a", buffering=1) if log_path else None
        self.stats: Counter[str] = Counter()
        self._pods: dict[str, tuple[str, list[str]]] = {}  # pod uid -> (node, images)
        threading.Thread(target=self._run, daemon=True, name="image-model").start()

    def _node(self, name: str) -> _Node:
        return self._nodes.setdefault(name, _Node())

    def acquire(
        self, node: str, uid: str, images: list[str], ready: Callable[[str, float], None]
    ) -> None:
        """Pod ``uid`` on ``node`` needs ``images``; ``ready(verdict, waited_s)`` is called
        (from the model's thread, or at once) when all are on the node."""
        t0 = time.monotonic()
        with self._lock:
            n = self._node(node)
            if uid in self._pods:
                return
            self._pods[uid] = (node, images)
            n.pods += 1
            missing: list[str] = []
            verdicts = []
            for image in images:
                n.in_use[image] += 1
                if image in n.cache:
                    n.cache.move_to_end(image)
                    verdicts.append("hit")
                    self.stats["hits"] += 1
                elif image in n.pulls:
                    missing.append(image)
                    verdicts.append("wait")
                    self.stats["waits"] += 1
                else:
                    size = image_size(image, self.p)
                    n.pulls[image] = [size, t0, []]
                    missing.append(image)
                    verdicts.append("miss")
                    self.stats["pulls"] += 1
                    self.stats["pulled_gb"] += size / GB
            verdict = ",".join(verdicts)
            if not missing:
                self._event(node, n)
                done = True
            else:
                done = False
                left = set(missing)

                def one(image: str) -> None:
                    left.discard(image)
                    if not left:
                        ready(verdict, time.monotonic() - t0)

                for image in missing:
                    n.pulls[image][2].append(one)
                self._event(node, n)
        if done:
            ready(verdict, 0.0)

    def release(self, uid: str) -> None:
        """Pod ``uid`` is gone: its images may be evicted again."""
        with self._lock:
            node, images = self._pods.pop(uid, (None, []))
            if node is None:
                return
            n = self._node(node)
            n.pods -= 1
            for image in images:
                n.in_use[image] -= 1
                if n.in_use[image] <= 0:
                    del n.in_use[image]
            self._event(node, n)

    def cached(self, node: str) -> list[str]:
        """Images on ``node``'s disk, least recently used first."""
        with self._lock:
            return list(self._node(node).cache)

    def _store(self, n: _Node, image: str, size: float) -> None:
        while n.used + size > self.disk:
            victim = next((i for i in n.cache if n.in_use.get(i, 0) == 0), None)
            if victim is None:
                self.stats["overcommits"] += 1
                break
            n.used -= n.cache.pop(victim)
            self.stats["evictions"] += 1
        n.cache[image] = size
        n.used += size

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(self.p["tick_s"])
            now = time.monotonic()
            dt, last = now - last, now
            callbacks: list[Callable[[str], None]] = []
            with self._lock:
                for name, n in self._nodes.items():
                    if not n.pulls:
                        continue
                    share = self.bw * dt / len(n.pulls)
                    finished = []
                    for image, st in n.pulls.items():
                        st[0] -= share
                        if st[0] <= 0:
                            finished.append(image)
                    for image in finished:
                        _, _, cbs = n.pulls.pop(image)
                        self._store(n, image, image_size(image, self.p))
                        callbacks += [lambda cb=cb, i=image: cb(i) for cb in cbs]
                    if finished:
                        self._event(name, n)
            for cb in callbacks:
                cb()  # type: ignore[call-arg]

    def _event(self, node: str, n: _Node) -> None:
        if self._log is None:
            return
        self._log.write(json.dumps({
            "t": round(time.time(), 3), "node": node, "pulls": len(n.pulls),
            "pods": n.pods, "disk_gb": round(n.used / GB, 1),
            "evictions": self.stats["evictions"], "pulled": self.stats["pulls"],
        }) + "\n")
