"""Manifests the backend sends: agent-sandbox v1beta1 objects and plain Pods.

Field names follow the v1.0.3 Go types: ``SandboxTemplate.spec.podTemplate`` (the shared
``SandboxBlueprint``), ``SandboxWarmPool.spec.{replicas,sandboxTemplateRef.name}``,
``SandboxClaim.spec.warmPoolRef.name``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandpool.core import errors

__all__ = [
    "CLAIM",
    "EXT_GROUP",
    "MANAGED_BY",
    "PodImage",
    "RUN_ID_LABEL",
    "TEMPLATE",
    "VERSION",
    "WARMPOOL",
    "check_run_id",
    "claim",
    "image_key",
    "ns_path",
    "pod",
    "pod_spec",
    "template",
    "warm_pool",
]

EXT_GROUP = "extensions.agents.x-k8s.io"
CORE_GROUP = "agents.x-k8s.io"
VERSION = "v1beta1"
TEMPLATE, WARMPOOL, CLAIM, SANDBOX = (
    "sandboxtemplates",
    "sandboxwarmpools",
    "sandboxclaims",
    "sandboxes",
)
RUN_ID_LABEL = "sandpool.io/run-id"
IMAGE_LABEL = "sandpool.io/image"
MANAGED_BY = {"app.kubernetes.io/managed-by": "sandpool"}
#: Per-object label: deletes of many objects are batched as one collection delete with
#: ``sandpool.io/obj in (...)``.
OBJ_LABEL = "sandpool.io/obj"
PREPULL_LABEL = "sandpool.io/prepull"
HOSTNAME = "kubernetes.io/hostname"


@dataclass(frozen=True)
class PodImage:
    """What one task image becomes in a pod.

    Usage: ``PodImage("ghcr-mirror.example/swe/toolz:1.0", workdir="/testbed")``.

    Attributes:
        image: The container image reference.
        workdir: Path of the task repo inside the container (SWE-bench images: ``/testbed``).
        env: Literal environment variables of the container.
        head: The commit the image's workdir is at, when known (the pool then skips the
            checkout on a fresh sandbox's first claim for that commit).
        annotations: Annotations of every pod of the image (for the cluster's own
            controllers or admission; sandpool reads none).
    """

    image: str
    workdir: str = "/testbed"
    env: Mapping[str, str] = field(default_factory=dict)
    head: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it can be a label value and part of object names.

    Raises:
        ConfigError: It is not 1-16 lower-case letters, digits or '-' (starting and ending
            with a letter or digit).
    """
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?", run_id):
        raise errors.ConfigError(
            f"run_id={run_id!r} must be 1-16 lower-case letters, digits or '-'"
        )
    return run_id


def image_key(image: str) -> str:
    """A short, label-safe, stable key for an image name (8 hex of its SHA-256)."""
    return hashlib.sha256(image.encode()).hexdigest()[:8]


def slug(image: str, n: int = 16) -> str:
    """A DNS-label-safe fragment of an image name, for readable object names."""
    tail = image.rsplit("/", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")[:n].strip("-") or "img"


def labels(run_id: str, image: str | None = None) -> dict[str, str]:
    out = {RUN_ID_LABEL: run_id, **MANAGED_BY}
    if image is not None:
        out[IMAGE_LABEL] = image_key(image)
    return out


def pod_spec(
    pi: PodImage,
    *,
    container: str,
    command: Sequence[str],
    resources: Mapping[str, Any],
    runtime_class: str | None,
    node_selector: Mapping[str, str] | None,
    tolerations: Sequence[Mapping[str, Any]] | None,
    node: str | None = None,
    disk_bytes: int | None = None,
    read_only_root: bool = False,
) -> dict[str, Any]:
    """The PodSpec shared by templates and plain pods: one long-sleeping container.

    ``node`` (from the placement plan) adds a required node affinity to that
    ``kubernetes.io/hostname``, so the image's sandboxes run where it was prepulled.
    ``read_only_root`` (or ``disk_bytes``) gives the pod :func:`scratch_volume`'s layout."""
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": container,
                "image": pi.image,
                "command": list(command),
                "workingDir": pi.workdir,
                "env": [{"name": k, "value": v} for k, v in pi.env.items()],
                "resources": dict(resources),
                # A raw socket forges what the node's rules match (a source address, an
                # IPv6 frame): no network means none.
                "securityContext": {"capabilities": {"drop": ["NET_RAW"]}},
            }
        ],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # containerd's RuntimeDefault profile leaves add_key, request_key and keyctl out of its
        # allow list: kernel keyrings are not namespaced, and a key one pod stored would reach
        # the next rollout and concurrent pods. The agent adds sandpool's own filter on top
        # (agent.seccomp: no limits set on other processes), which every command inherits.
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if read_only_root or disk_bytes:
        scratch_volume(spec, pi, disk_bytes)
    if node:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": HOSTNAME, "operator": "In", "values": [node]}
            ]}]
        }}}
    return spec


#: The pod's one writable volume, and where its filler sees it.
SCRATCH_VOLUME = "sandpool-scratch"
_FILL_AT = "/sandpool-fill"
#: Where the pod's service directory lives (``_service``), on the scratch volume.
RUN_DIR = "/run/sandpool"


def scratch_volume(spec: dict[str, Any], pi: PodImage, disk_bytes: int | None) -> None:
    """Make the image's root file system read-only and give the pod one writable volume, an
    ``emptyDir`` holding a copy of the image's workdir, mounted at the workdir, ``/tmp`` and
    :data:`RUN_DIR` (the service's directory). An init container of the same image copies the
    workdir in (``cp -a``: modes, times, ``.git`` and all).

    With ``disk_bytes`` the volume is memory-backed (a tmpfs) of that size: a write past it
    (the repo copy included) fails with ENOSPC inside the pod, as the local backend's quota
    does, instead of an eviction, and its pages count against the pod's memory limit. Without,
    it is on the node's disk, uncapped. Either way a write anywhere else on the root fails
    with EROFS, so a rollout can change nothing of the image outside the workdir and ``/tmp``
    (what the runtime mounts writable besides, ``/dev`` and ``/etc/hosts``, is compared by
    the in-place reset: :meth:`KubernetesSandbox.changes_outside_repo`).
    """
    c = spec["containers"][0]
    c["securityContext"] = {**c.get("securityContext", {}), "readOnlyRootFilesystem": True}
    c["volumeMounts"] = [
        {"name": SCRATCH_VOLUME, "mountPath": pi.workdir, "subPath": "repo"},
        {"name": SCRATCH_VOLUME, "mountPath": "/tmp", "subPath": "tmp"},
        {"name": SCRATCH_VOLUME, "mountPath": RUN_DIR, "subPath": "run"},
    ]
    empty: dict[str, Any] = {}
    if disk_bytes:
        empty = {"medium": "Memory", "sizeLimit": str(disk_bytes)}
    spec["volumes"] = [{"name": SCRATCH_VOLUME, "emptyDir": empty}]
    fill = (f'mkdir -p {_FILL_AT}/repo {_FILL_AT}/run && cp -a "$0/." {_FILL_AT}/repo/ '
            f"&& mkdir -m 1777 {_FILL_AT}/tmp")
    spec["initContainers"] = [{
        "name": "sandpool-fill",
        "image": pi.image,
        "command": ["/bin/sh", "-c", fill, pi.workdir],
        "resources": dict(c["resources"]),
        "volumeMounts": [{"name": SCRATCH_VOLUME, "mountPath": _FILL_AT}],
    }]


def _pod_meta(run_id: str, image: str, pi: PodImage) -> dict[str, Any]:
    return {"labels": labels(run_id, image), "annotations": dict(pi.annotations)}


def template(
    name: str, run_id: str, image: str, pi: PodImage, spec: dict[str, Any]
) -> dict[str, Any]:
    """A SandboxTemplate (mirrors agent-sandbox v1beta1 SandboxTemplate) for one image."""
    return {
        "apiVersion": f"{EXT_GROUP}/{VERSION}",
        "kind": "SandboxTemplate",
        "metadata": {"name": name, "labels": labels(run_id, image)},
        "spec": {
            "podTemplate": {"metadata": _pod_meta(run_id, image, pi), "spec": spec},
            # No NetworkPolicy per template: sandboxes get none of their own (the pod spec
            # decides), and a test cluster has no CNI to enforce one.
            "networkPolicyManagement": "Unmanaged",
        },
    }


def warm_pool(
    name: str, run_id: str, image: str, template_name: str, replicas: int
) -> dict[str, Any]:
    """A SandboxWarmPool (mirrors agent-sandbox v1beta1 SandboxWarmPool) of ``replicas``."""
    return {
        "apiVersion": f"{EXT_GROUP}/{VERSION}",
        "kind": "SandboxWarmPool",
        "metadata": {"name": name, "labels": labels(run_id, image)},
        "spec": {"replicas": replicas, "sandboxTemplateRef": {"name": template_name}},
    }


def claim(name: str, run_id: str, image: str, pool_name: str) -> dict[str, Any]:
    """A SandboxClaim (mirrors agent-sandbox v1beta1 SandboxClaim) on warm pool ``pool_name``."""
    return {
        "apiVersion": f"{EXT_GROUP}/{VERSION}",
        "kind": "SandboxClaim",
        "metadata": {"name": name, "labels": {**labels(run_id, image), OBJ_LABEL: name}},
        "spec": {"warmPoolRef": {"name": pool_name}},
    }


def pod(name: str, run_id: str, image: str, pi: PodImage, spec: dict[str, Any]) -> dict[str, Any]:
    """A plain Pod for one rollout (the ``pods`` mode)."""
    meta = _pod_meta(run_id, image, pi)
    meta["labels"][OBJ_LABEL] = name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **meta}, "spec": spec}


def sandbox(
    name: str, run_id: str, image: str, pi: PodImage, spec: dict[str, Any]
) -> dict[str, Any]:
    """An agent-sandbox core Sandbox (mirrors v1beta1 Sandbox: ``spec.podTemplate``) for one
    sandbox: the controller creates its pod, named like it. No Service of its own."""
    return {
        "apiVersion": f"{CORE_GROUP}/{VERSION}",
        "kind": "Sandbox",
        "metadata": {"name": name, "labels": {**labels(run_id, image), OBJ_LABEL: name}},
        "spec": {
            "podTemplate": {"metadata": _pod_meta(run_id, image, pi), "spec": spec},
            "service": False,
        },
    }


def prepull_pod(
    name: str, run_id: str, window: str, node: str, images: Sequence[str],
    tolerations: Sequence[Mapping[str, Any]] | None, runtime_class: str | None,
) -> dict[str, Any]:
    """One pod on ``node`` with a container per image of ``images`` (each exits at once):
    the kubelet pulls them all; the pod is deleted once it ran (or is Ready, on kwok)."""
    spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [
            {"name": f"i{i}", "image": img, "command": ["sh", "-c", "exit 0"],
             "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}
            for i, img in enumerate(images)
        ],
    }
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    lab = {**labels(run_id), PREPULL_LABEL: window}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": lab},
            "spec": spec}


def ns_path(namespace: str, resource: str) -> str:
    """The REST collection path of ``resource`` (``pods`` or an agent-sandbox plural) in
    ``namespace``."""
    if resource == "pods":
        return f"/api/v1/namespaces/{namespace}/pods"
    group = CORE_GROUP if resource == SANDBOX else EXT_GROUP
    return f"/apis/{group}/{VERSION}/namespaces/{namespace}/{resource}"
