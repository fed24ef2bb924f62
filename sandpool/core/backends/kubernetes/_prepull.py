"""Placement and prepull on the cluster: plan images onto nodes, pull them before rollouts ask.

:meth:`Placement.place` reads the schedulable nodes, computes a
:class:`~._placement.PlacementPlan` and makes every image's pods (templates, Sandbox
objects, plain pods) require the node it was planned on; :meth:`Placement.prepull` creates
one pod per node whose containers are that node's images of a window, waits until the node
has them (the pod ran, or is Ready), and deletes the pods in one collection delete. A
window's prepull can run while the previous window's rollouts do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._manifests import ns_path
from sandpool.core.backends.kubernetes._placement import NodeCapacity, PlacementPlan, plan
from sandpool.core.backends.kubernetes._pods import pod_ready
from sandpool.core.backends.kubernetes._watch import Informer

__all__ = ["Placement", "parse_quantity"]

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
           "T": 1e12, "m": 1e-3}


def parse_quantity(q: str) -> float:
    """A Kubernetes resource quantity (``100Gi``, ``1.5T``, ``500m``) as a number."""
    for suf in sorted(_SUFFIX, key=len, reverse=True):
        if q.endswith(suf):
            return float(q[: -len(suf)]) * _SUFFIX[suf]
    return float(q)


class Placement:
    """Where one run's images go, and their pulls ahead of the rollouts.

    Args:
        http: The HTTP layer.
        namespace: Where prepull pods are made.
        run_id: The run-id label value.
        images: Task image -> PodImage; :meth:`place` pins each image's pods to its node.
        pods: The run's shared pod watch (started before :meth:`prepull`).
    """

    def __init__(
        self, http: KubeHttp, namespace: str, run_id: str, images: PodImages, pods: Informer
    ) -> None:
        self._http = http
        self.namespace = namespace
        self.run_id = run_id
        self._images = images
        self._pods = pods

    async def place(
        self,
        images: Sequence[str],
        sizes: Mapping[str, float],
        *,
        slots_per_image: int = 1,
        node_disk_bytes: float | None = None,
        pipeline_fraction: float = 0.5,
    ) -> PlacementPlan:
        """Plan ``images`` onto the cluster's schedulable nodes and steer their pods there.

        Args:
            images: Task images in rollout order.
            sizes: Image -> bytes (e.g. from the registry's manifests).
            slots_per_image: Pods one image's rollouts hold at once.
            node_disk_bytes: Image disk per node; default each node's allocatable
                ``ephemeral-storage``.
            pipeline_fraction: See :func:`~._placement.plan`.

        Returns:
            The plan; call before :meth:`hydrate` of its images (templates carry the node).

        Raises:
            ConfigError: See :func:`~._placement.plan`; or no disk size is known.
        """
        listed = await self._http.request("GET", "/api/v1/nodes")
        nodes = []
        for node in (listed or {}).get("items", []):
            spec, st = node.get("spec") or {}, node.get("status") or {}
            if spec.get("unschedulable") or spec.get("taints"):
                continue
            alloc = st.get("allocatable") or {}
            disk = node_disk_bytes
            if disk is None and "ephemeral-storage" in alloc:
                disk = parse_quantity(alloc["ephemeral-storage"])
            if disk is None:
                raise errors.ConfigError(
                    f"node {node['metadata']['name']} reports no ephemeral-storage; pass "
                    "node_disk_bytes= to place()"
                )
            pods = int(parse_quantity(alloc.get("pods", "110")))
            nodes.append(NodeCapacity(node["metadata"]["name"], disk, pods))
        result = plan(images, sizes, nodes, slots_per_image=slots_per_image,
                      pipeline_fraction=pipeline_fraction)
        self._images.pin(result.node_of)
        return result

    async def prepull(
        self, window: Mapping[str, str], *, name: str, timeout: float = 1800
    ) -> dict[str, Any]:
        """Pull each node's images of ``window`` (image -> node) onto it; return timings.

        One pod per node (a container per image), then one collection delete of them all.

        Returns:
            ``{"pods": n, "images": n, "seconds": s}``.

        Raises:
            InfraTimeout: Not every node had its images within ``timeout`` seconds.
            SandboxStartError: A prepull pod failed (image pull error).
        """
        http = self._http
        t0 = time.monotonic()
        per: dict[str, list[str]] = {}
        for img, node in window.items():
            per.setdefault(node, []).append(self._images.resolve(img).image)
        pod_names = []
        for i, (node, imgs) in enumerate(sorted(per.items())):
            pod_name = f"sp-{self.run_id}-pre-{m.slug(name, 20)}-{i}"
            await http.request(
                "POST",
                ns_path(self.namespace, "pods"),
                body=m.prepull_pod(pod_name, self.run_id, name, node, imgs,
                                   self._images.tolerations, self._images.runtime_class),
            )
            pod_names.append(pod_name)

        def pulled(pod: dict[str, Any] | None) -> bool | None:
            if pod is None:
                return None
            phase = (pod.get("status") or {}).get("phase")
            if phase == "Succeeded" or pod_ready(pod):
                return True
            if phase == "Failed":
                raise errors.SandboxStartError(
                    f"prepull pod {pod['metadata']['name']} failed: "
                    f"{(pod.get('status') or {}).get('message', '')}"
                )
            return None

        try:
            await asyncio.gather(*(self._pods.wait(p, pulled, timeout) for p in pod_names))
        except TimeoutError:
            raise errors.InfraTimeout(
                f"prepull {name}: not all of {len(pod_names)} nodes had their images within "
                f"{timeout:.0f} s"
            ) from None
        finally:
            await http.request(
                "DELETE",
                ns_path(self.namespace, "pods"),
                query={"labelSelector": f"{m.RUN_ID_LABEL}={self.run_id},{m.PREPULL_LABEL}={name}",
                       "gracePeriodSeconds": "0"},
                ok_missing=True,
            )
        return {"pods": len(pod_names), "images": len(window),
                "seconds": time.monotonic() - t0}
