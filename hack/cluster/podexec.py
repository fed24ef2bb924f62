"""The kwok objects that make exec and port-forward work on a kwok pod.

kwok (kwok.x-k8s.io/v1alpha1) runs a pod's exec as a local process described by an ``Exec``
named and namespaced like the pod, and a port-forward as a command described by a
``PortForward``. provisioner.py creates both, owned by the pod, once the pod's
directories exist (podfiles.py). Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kubeapi import ApiError, Kube

# Run by kwok for each port-forward stream (stdin/stdout) of a declared port: pipes the stream
# to and from the unix socket argv[1] until the server closes it. Connects by a relative name:
# a pod's path can be longer than a socket address holds (108 bytes).
BRIDGE = r"""
import os, socket, sys, threading
s = socket.socket(socket.AF_UNIX)
try:
    os.chdir(os.path.dirname(sys.argv[1]))
    s.connect(os.path.basename(sys.argv[1]))
except OSError as e:
    sys.exit(f"nothing listens on {sys.argv[1]}: {e}")
def up():
    try:
        while data := os.read(0, 65536):
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=up, daemon=True).start()
try:
    while data := s.recv(65536):
        os.write(1, data)
except OSError:
    pass
"""


def exec_object(pod: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The ``Exec`` of ``pod``: each container's exec runs in ``workdir`` with the container's
    literal ``env`` values, the pod's ``SANDPOOL_*`` paths and its ``workingDir`` (where
    container.sh mounts the workdir)."""
    meta = pod["metadata"]
    ns, name = meta["namespace"], meta["name"]
    base_env = [
        {"name": "SANDPOOL_POD_NAME", "value": name},
        {"name": "SANDPOOL_POD_NAMESPACE", "value": ns},
        {"name": "SANDPOOL_WORKDIR", "value": str(workdir)},
        {"name": "SANDPOOL_POD_RUN", "value": f"{workdir}.run"},
        {"name": "SANDPOOL_POD_PORTS", "value": f"{workdir}.run/ports"},
    ]
    targets = []
    for c in pod["spec"]["containers"]:
        envs = [
            {"name": e["name"], "value": e.get("value", "")}
            for e in c.get("env") or []
            if "valueFrom" not in e
        ]
        image_wd = [{"name": "SANDPOOL_IMAGE_WORKDIR", "value": c.get("workingDir", "")}]
        targets.append(
            {
                "containers": [c["name"]],
                "local": {"workDir": str(workdir), "envs": envs + base_env + image_wd},
            }
        )
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Exec",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"app.kubernetes.io/managed-by": "sandpool-provisioner"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": meta["uid"]}
            ],
        },
        "spec": {"execs": targets},
    }


def port_forward_object(pod: dict[str, Any], workdir: Path) -> dict[str, Any] | None:
    """The ``PortForward`` of ``pod``, or None when its containers declare no ``ports``: a
    forward of port P bridges the stream to the unix socket ``<workdir>.run/ports/P``."""
    ports = sorted(
        {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []}
    )
    if not ports:
        return None
    forwards = [
        {"ports": [p], "command": [sys.executable, "-c", BRIDGE, f"{workdir}.run/ports/{p}"]}
        for p in ports
    ]
    return dict(exec_object(pod, workdir), kind="PortForward", spec={"forwards": forwards})


def apply(kube: Kube, obj: dict[str, Any]) -> None:
    """Create the kwok object ``obj`` (or replace the one of its name).

    Raises:
        ApiError: The API server refused it (other than as already existing).
        OSError: The connection failed.
    """
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    path = f"/apis/kwok.x-k8s.io/v1alpha1/namespaces/{ns}/{obj['kind'].lower()}s"
    try:
        kube.request("POST", path, obj)
    except ApiError as e:
        if e.status != 409:
            raise
        old = kube.request("GET", f"{path}/{name}")
        obj = dict(
            obj, metadata=dict(obj["metadata"], resourceVersion=old["metadata"]["resourceVersion"])
        )
        kube.request("PUT", f"{path}/{name}", obj)
