"""The flat start-latency model of kwok pods: a per-node image cache, jittered delays.

A pod's start is its images' pull plus the sandbox's boot (README.md, "Simulated start latency"). An
image not on the node costs ``pull_ms``; one on it (pulled earlier, in ``preload_images``,
or the pod annotated ``sandpool.io/image-cached: "true"``) ``cached_pull_ms``; a pod whose
image another pod on the node is still pulling waits for that pull. Each delay is scaled by
``uniform(1 - jitter, 1 + jitter)``. The node's cached images are recorded in its
``sandpool.io/cached-images`` annotation, and read back from it. The seed model is
imagemodel.py's. Used by provisioner.py. Standard library only.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from kubeapi import ApiError, Kube

ANN = "sandpool.io/"
CACHED_IMAGES = ANN + "cached-images"
LOG = logging.getLogger("provisioner")


class StartDelays:
    """Delays from the provisioner's config ``cfg`` (``pull_ms``, ``cached_pull_ms``,
    ``boot_ms``, ``jitter``, ``preload_images``); safe to share between threads."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rng = random.Random()
        # node -> image -> monotonic time at which its (simulated) pull completes.
        self._images: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def jitter(self, ms: float) -> float:
        j = float(self.cfg["jitter"])
        return max(0.0, ms * self.rng.uniform(1 - j, 1 + j))

    def boot_ms(self) -> float:
        return self.jitter(float(self.cfg["boot_ms"]))

    def cached_pull_ms(self) -> float:
        return self.jitter(float(self.cfg["cached_pull_ms"]))

    def for_pod(self, pod: dict[str, Any]) -> tuple[float, float, str, list[str]]:
        """Return (pull_ms, boot_ms, cache verdict, images newly pulled on the node) for a
        pod bound to a node; the verdict is ``hit``, ``wait`` or ``miss`` per image."""
        node = pod["spec"]["nodeName"]
        ann = pod["metadata"].get("annotations") or {}
        images = list(dict.fromkeys(c["image"] for c in pod["spec"]["containers"]))
        force_cached = ann.get(ANN + "image-cached") == "true"
        now = time.monotonic()
        pull_ms = 0.0
        new: list[str] = []
        verdicts = []
        with self._lock:
            cache = self._images.setdefault(node, {})
            for image in images:
                ready_at = cache.get(image)
                if (
                    force_cached
                    or image in self.cfg["preload_images"]
                    or (ready_at is not None and ready_at <= now)
                ):
                    pull_ms += self.cached_pull_ms()
                    verdicts.append("hit")
                elif ready_at is not None:
                    # Another pod on this node is pulling it: wait for that pull.
                    pull_ms += (ready_at - now) * 1000 + self.cached_pull_ms()
                    verdicts.append("wait")
                else:
                    pull_ms += self.jitter(float(self.cfg["pull_ms"]))
                    # Pulls on one node are serialized, like the kubelet's default.
                    cache[image] = now + pull_ms / 1000
                    new.append(image)
                    verdicts.append("miss")
        return pull_ms, self.boot_ms(), ",".join(verdicts), new

    def node_event(self, node: dict[str, Any]) -> None:
        """Take the images a Node object's annotation records as cached on it."""
        ann = (node["metadata"].get("annotations") or {}).get(CACHED_IMAGES, "")
        with self._lock:
            cache = self._images.setdefault(node["metadata"]["name"], {})
            for image in filter(None, (s.strip() for s in ann.split(","))):
                cache.setdefault(image, 0.0)

    def record(self, kube: Kube, node: str) -> None:
        """Write ``node``'s cached images into its annotation (best effort: a failure is logged)."""
        with self._lock:
            images = sorted(self._images.get(node, {}))
        try:
            kube.request(
                "PATCH",
                f"/api/v1/nodes/{node}",
                {"metadata": {"annotations": {CACHED_IMAGES: ",".join(images)}}},
                content_type="application/merge-patch+json",
            )
        except (ApiError, OSError) as e:
            LOG.warning("could not record cached images on node %s: %s", node, e)
