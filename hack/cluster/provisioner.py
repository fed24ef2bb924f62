"""Give every pod on the kwok nodes its own working directory and exec target.

Started by ``cluster.py up``; it watches pods and nodes and, for each pod bound to a
node:

1. creates ``<root>/pods/<namespace>/<name>/``; if the pod carries the annotation
   ``sandpool.io/workdir-source: <host dir>``, copies that directory's contents in
   (``cp -a``);
2. creates a kwok ``Exec`` (kwok.x-k8s.io/v1alpha1) named and namespaced like the pod,
   owned by the pod, whose ``local.workDir`` is that directory, so pod exec runs
   there (per container, with the container's literal ``env`` values and its
   ``workingDir``, where ``container.sh`` mounts the directory for the exec);
3. computes the simulated start latency (image pull + sandbox boot, see README.md)
   and annotates the pod with it and with ``sandpool.io/provisioned: "true"``;
   the kwok Stages only start the pod after that annotation, so a pod is never
   Ready before exec into it works;
4. gives the pod a run directory ``<workdir>.run`` (``$SANDPOOL_POD_RUN`` in its execs) and,
   when its containers declare ``ports``, a kwok ``PortForward`` (kwok.x-k8s.io/v1alpha1)
   named like the pod: kwok nodes share the host's network, so a process of the pod that
   serves port P listens on the unix socket ``$SANDPOOL_POD_PORTS/P`` (``<run>/ports/P``),
   and a port-forward of P (``pods/portforward``) runs a bridge between the stream and that
   socket. No TCP port is opened on the host.

When a pod is deleted, its directories are removed (the Exec goes with the pod through
its owner reference). Standard library only.

One file: it runs as one stdlib process started by ``cluster.py up`` (before any venv
exists); :class:`Provisioner` is one watch loop whose provisioning, port bridges and pod
cleanup share its per-pod state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from imagemodel import ImageModel
from kubeapi import ApiError, Kube

ANN = "sandpool.io/"
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
CACHED_IMAGES = ANN + "cached-images"
LOG = logging.getLogger("provisioner")


class Provisioner:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.root = Path(cfg["root"])
        self.pki = Path(cfg["pki"])
        self.server = cfg["server"]
        self.rng = random.Random()
        # node -> image -> monotonic time at which its (simulated) pull completes.
        self._images: dict[str, dict[str, float]] = {}
        self._images_lock = threading.Lock()
        self._queues = [queue.Queue() for _ in range(int(cfg.get("workers", 8)))]
        self._done: set[str] = set()  # pod uids provisioned (or given up on)
        self._real_nodes = frozenset(cfg.get("real_nodes", ()))
        # The seed's image conditions (imagemodel.py), or None for the flat pull model.
        self.model = (
            ImageModel(cfg["image_model"], self.root / "image-model.jsonl")
            if cfg.get("image_model")
            else None
        )
        self._reap: set[str] = set()  # workdirs of deleted pods whose processes must die
        self._reap_lock = threading.Lock()

    def kube(self) -> Kube:
        return Kube.from_pki(self.server, self.pki, user_agent="sandpool-provisioner")

    # ---- start latency model -------------------------------------------------
    def _jitter(self, ms: float) -> float:
        j = float(self.cfg["jitter"])
        return max(0.0, ms * self.rng.uniform(1 - j, 1 + j))

    def start_delays(self, pod: dict[str, Any]) -> tuple[float, float, str, list[str]]:
        """Return (pull_ms, boot_ms, cache verdict, images newly pulled on the node)."""
        node = pod["spec"]["nodeName"]
        ann = pod["metadata"].get("annotations") or {}
        images = list(dict.fromkeys(c["image"] for c in pod["spec"]["containers"]))
        force_cached = ann.get(ANN + "image-cached") == "true"
        now = time.monotonic()
        pull_ms = 0.0
        new: list[str] = []
        verdicts = []
        with self._images_lock:
            cache = self._images.setdefault(node, {})
            for image in images:
                ready_at = cache.get(image)
                if (
                    force_cached
                    or image in self.cfg["preload_images"]
                    or (ready_at is not None and ready_at <= now)
                ):
                    pull_ms += self._jitter(float(self.cfg["cached_pull_ms"]))
                    verdicts.append("hit")
                elif ready_at is not None:
                    # Another pod on this node is pulling it: wait for that pull.
                    pull_ms += (ready_at - now) * 1000 + self._jitter(
                        float(self.cfg["cached_pull_ms"])
                    )
                    verdicts.append("wait")
                else:
                    ms = self._jitter(float(self.cfg["pull_ms"]))
                    pull_ms += ms
                    # Pulls on one node are serialized, like the kubelet's default.
                    cache[image] = now + pull_ms / 1000
                    new.append(image)
                    verdicts.append("miss")
        boot_ms = self._jitter(float(self.cfg["boot_ms"]))
        return pull_ms, boot_ms, ",".join(verdicts), new

    def _node_event(self, node: dict[str, Any]) -> None:
        ann = (node["metadata"].get("annotations") or {}).get(CACHED_IMAGES, "")
        with self._images_lock:
            cache = self._images.setdefault(node["metadata"]["name"], {})
            for image in filter(None, (s.strip() for s in ann.split(","))):
                cache.setdefault(image, 0.0)

    # ---- per pod ---------------------------------------------------------------
    def workdir(self, ns: str, name: str) -> Path:
        return self.root / "pods" / ns / name

    def _uid_file(self, ns: str, name: str) -> Path:
        return self.root / "meta" / ns / f"{name}.uid"

    def provision(self, kube: Kube, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        ann = meta.get("annotations") or {}
        t0 = time.monotonic()
        workdir = self.workdir(ns, name)
        uid_file = self._uid_file(ns, name)
        if workdir.exists():
            old = uid_file.read_text() if uid_file.exists() else ""
            if old != uid:
                shutil.rmtree(workdir, ignore_errors=True)
                shutil.rmtree(f"{workdir}.run", ignore_errors=True)
        uid_file.parent.mkdir(parents=True, exist_ok=True)
        uid_file.write_text(uid)
        workdir.mkdir(parents=True, exist_ok=True)
        source = ann.get(ANN + "workdir-source")
        if source:
            if not Path(source).is_dir():
                self._fail(kube, pod, f"workdir-source {source!r} is not a directory")
                return
            res = subprocess.run(
                ["cp", "-a", f"{source}/.", str(workdir)],
                check=False,
                capture_output=True,
                text=True,
            )
            if res.returncode:
                self._fail(kube, pod, f"copy of {source!r} failed: {res.stderr.strip()}")
                return

        base_env = [
            {"name": "SANDPOOL_POD_NAME", "value": name},
            {"name": "SANDPOOL_POD_NAMESPACE", "value": ns},
            {"name": "SANDPOOL_WORKDIR", "value": str(workdir)},
            {"name": "SANDPOOL_POD_RUN", "value": f"{workdir}.run"},
            {"name": "SANDPOOL_POD_PORTS", "value": f"{workdir}.run/ports"},
        ]
        (Path(f"{workdir}.run") / "ports").mkdir(parents=True, exist_ok=True)
        targets = []
        for c in pod["spec"]["containers"]:
            envs = [
                {"name": e["name"], "value": e.get("value", "")}
                for e in c.get("env") or []
                if "valueFrom" not in e
            ]
            # Where container.sh mounts the workdir for the exec (the container's view).
            image_wd = [{"name": "SANDPOOL_IMAGE_WORKDIR", "value": c.get("workingDir", "")}]
            targets.append(
                {
                    "containers": [c["name"]],
                    "local": {"workDir": str(workdir), "envs": envs + base_env + image_wd},
                }
            )
        exec_obj = {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Exec",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": "sandpool-provisioner"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}],
            },
            "spec": {"execs": targets},
        }
        self._apply(kube, ns, "execs", exec_obj)
        ports = sorted({p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []})
        if ports:
            forwards = [
                {"ports": [p], "command": [sys.executable, "-c", BRIDGE, f"{workdir}.run/ports/{p}"]}
                for p in ports
            ]
            self._apply(kube, ns, "portforwards", dict(
                exec_obj, kind="PortForward", spec={"forwards": forwards}))

        if self.model is not None:
            # The pod starts when the model says its images are on the node.
            self.model.acquire(
                pod["spec"]["nodeName"],
                uid,
                list(dict.fromkeys(c["image"] for c in pod["spec"]["containers"])),
                lambda verdict, waited: self._dispatch("READY", pod, (verdict, waited, t0)),
            )
            return
        pull_ms, boot_ms, verdict, new_images = self.start_delays(pod)
        self._mark_provisioned(kube, pod, verdict, pull_ms, boot_ms, t0)
        if new_images:
            self._record_pull(kube, pod["spec"]["nodeName"])

    @staticmethod
    def _apply(kube: Kube, ns: str, resource: str, obj: dict[str, Any]) -> None:
        """Create the kwok object ``obj`` (or replace the one of its name)."""
        path = f"/apis/kwok.x-k8s.io/v1alpha1/namespaces/{ns}/{resource}"
        name = obj["metadata"]["name"]
        try:
            kube.request("POST", path, obj)
        except ApiError as e:
            if e.status != 409:
                raise
            old = kube.request("GET", f"{path}/{name}")
            obj = dict(obj, metadata=dict(obj["metadata"], resourceVersion=old["metadata"]["resourceVersion"]))
            kube.request("PUT", f"{path}/{name}", obj)

    def _mark_provisioned(
        self, kube: Kube, pod: dict[str, Any], verdict: str, pull_ms: float, boot_ms: float,
        t0: float, waited_s: float | None = None,
    ) -> None:
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        ann = meta.get("annotations") or {}
        workdir = self.workdir(ns, name)
        patch = {
            ANN + "provisioned": "true",
            ANN + "workdir": str(workdir),
            ANN + "image-cache": verdict,
        }
        # A delay the pod sets itself wins over the model.
        patch.setdefault(ANN + "pull-delay", ann.get(ANN + "pull-delay") or f"{int(pull_ms)}ms")
        patch.setdefault(ANN + "boot-delay", ann.get(ANN + "boot-delay") or f"{int(boot_ms)}ms")
        if waited_s is not None:
            patch[ANN + "pull-wait"] = f"{waited_s:.2f}s"
        try:
            kube.request(
                "PATCH",
                f"/api/v1/namespaces/{ns}/pods/{name}",
                {"metadata": {"annotations": patch, "uid": uid}},
                content_type="application/merge-patch+json",
            )
        except ApiError as e:
            if e.status in (404, 409, 422):  # deleted (or replaced: uid mismatch) meanwhile
                return
            raise
        LOG.info(
            "provisioned %s/%s in %.0f ms (pull %s %d ms, boot %d ms)",
            ns,
            name,
            (time.monotonic() - t0) * 1000,
            verdict,
            pull_ms,
            boot_ms,
        )

    def _record_pull(self, kube: Kube, node: str) -> None:
        with self._images_lock:
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

    def _fail(self, kube: Kube, pod: dict[str, Any], reason: str) -> None:
        """Report that the pod cannot start as a kubelet does: its containers wait with
        ``CreateContainerError`` and ``reason`` (the pod is never provisioned, so never starts)."""
        meta = pod["metadata"]
        LOG.error("pod %s/%s: %s", meta["namespace"], meta["name"], reason)
        waiting = [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
             "restartCount": 0, "started": False,
             "state": {"waiting": {"reason": "CreateContainerError", "message": reason}}}
            for c in pod["spec"]["containers"]
        ]
        try:
            kube.request(
                "PATCH",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": {"containerStatuses": waiting}},
                content_type="application/merge-patch+json",
            )
        except (ApiError, OSError) as e:
            LOG.warning("could not record the failure: %s", e)

    def cleanup(self, ns: str, name: str, uid: str | None) -> None:
        if self.model is not None and uid is not None:
            self.model.release(uid)
        with self._reap_lock:
            self._reap.add(str(self.workdir(ns, name)))
        uid_file = self._uid_file(ns, name)
        if not uid_file.exists():
            return
        if uid is not None and uid_file.read_text() != uid:
            return  # the directory belongs to a newer pod of the same name
        shutil.rmtree(self.workdir(ns, name), ignore_errors=True)
        # The pod's private /tmp (container.sh), next to its workdir.
        shutil.rmtree(f"{self.workdir(ns, name)}.tmp", ignore_errors=True)
        shutil.rmtree(f"{self.workdir(ns, name)}.run", ignore_errors=True)
        uid_file.unlink(missing_ok=True)
        LOG.info("removed workdir of %s/%s", ns, name)

    # ---- event plumbing ----------------------------------------------------------
    def _dispatch(self, kind: str, pod: dict[str, Any], extra: Any = None) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        self._queues[hash(key) % len(self._queues)].put((kind, pod, extra))

    def _reaper(self) -> None:
        """Kill the processes of deleted pods, as a kubelet stops a pod's containers.

        kwok's exec does not end a command when its stream closes, so a pod's long-lived
        exec (sandpool's agent session) and whatever its commands left running would outlive
        the pod. Every exec'd process carries ``SANDPOOL_WORKDIR=<the pod's workdir>``; one
        scan of /proc per interval serves every pod deleted in it.
        """
        while True:
            time.sleep(0.5)
            with self._reap_lock:
                batch, self._reap = self._reap, set()
            if not batch:
                continue
            needles = {f"SANDPOOL_WORKDIR={w}".encode() for w in batch}
            killed = 0
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    env = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if needles.intersection(env):
                    try:
                        os.kill(int(entry.name), signal.SIGKILL)
                        killed += 1
                    except OSError:
                        pass
            if killed:
                LOG.info("killed %d processes of %d deleted pods", killed, len(batch))

    def _worker(self, q: queue.Queue) -> None:
        kube = self.kube()
        while True:
            kind, pod, extra = q.get()
            meta = pod["metadata"]
            try:
                if kind == "READY":
                    verdict, waited, t0 = extra
                    boot_ms = self._jitter(float(self.cfg["boot_ms"]))
                    pull_ms = self._jitter(float(self.cfg["cached_pull_ms"]))
                    # Retried like a provision: a PATCH lost to a dropped connection left the
                    # pod Pending until its client's ready timeout (3 of 4,000 pods at 1,000
                    # images); the merge patch is idempotent.
                    self._retrying("mark provisioned", meta, lambda: self._mark_provisioned(
                        kube, pod, verdict, pull_ms, boot_ms, t0, waited))
                elif kind == "DELETED":
                    self._done.discard(meta["uid"])
                    self.cleanup(meta["namespace"], meta["name"], meta["uid"])
                elif meta["uid"] not in self._done:
                    self._retrying("provision", meta, lambda: self.provision(kube, pod))
                    self._done.add(meta["uid"])
            except Exception:  # keep the worker alive; the error is in the log
                LOG.exception("handling %s %s/%s", kind, meta.get("namespace"), meta.get("name"))

    @staticmethod
    def _retrying(what: str, meta: dict[str, Any], call: Any, attempts: int = 5) -> None:
        """``call()``, again after an API error or a dropped connection (backing off), at most
        ``attempts`` times; the last error is logged, not raised."""
        for attempt in range(attempts):
            try:
                call()
                return
            except (ApiError, OSError) as e:
                LOG.warning("%s %s/%s failed (attempt %d): %s", what, meta["namespace"], meta["name"],
                            attempt + 1, e)
                time.sleep(0.2 * 2**attempt)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if kind == "DELETED":
            self._dispatch(kind, pod)
            return
        if meta.get("deletionTimestamp") or not pod["spec"].get("nodeName"):
            return
        if pod["spec"]["nodeName"] in self._real_nodes:  # the kubelet's, not kwok's
            return
        if (meta.get("annotations") or {}).get(ANN + "provisioned") == "true":
            self._done.add(meta["uid"])
            return
        if meta["uid"] in self._done:
            return
        self._dispatch("SYNC", pod)

    def _list_watch(self, path: str, on_event, on_list) -> None:
        kube = self.kube()
        while True:
            try:
                lst = kube.request("GET", path)
                on_list(lst["items"])
                rv = lst["metadata"]["resourceVersion"]
                while True:
                    for ev in kube.watch(path, rv):
                        if ev["type"] == "ERROR":
                            raise ApiError(ev["object"].get("code", 500), ev["object"])
                        rv = ev["object"]["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            on_event(ev["type"], ev["object"])
            except (ApiError, OSError, ValueError) as e:
                LOG.info("re-listing %s after: %s", path, e)
                time.sleep(0.5)

    def _on_pod_list(self, pods: list[dict[str, Any]]) -> None:
        live = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p["metadata"]["uid"] for p in pods
        }
        meta_root = self.root / "meta"
        if meta_root.exists():
            for f in meta_root.glob("*/*.uid"):
                ns, name = f.parent.name, f.name[: -len(".uid")]
                if live.get((ns, name)) != f.read_text():
                    self._dispatch(
                        "DELETED",
                        {"metadata": {"namespace": ns, "name": name, "uid": f.read_text()}},
                    )
        for p in pods:
            self._on_pod("ADDED", p)

    def run(self) -> None:
        for q in self._queues:
            threading.Thread(target=self._worker, args=(q,), daemon=True).start()
        threading.Thread(target=self._reaper, daemon=True).start()
        threading.Thread(
            target=self._list_watch,
            args=(
                "/api/v1/nodes",
                lambda _k, n: self._node_event(n),
                lambda ns: [self._node_event(n) for n in ns],
            ),
            daemon=True,
        ).start()
        self._list_watch("/api/v1/pods", self._on_pod, self._on_pod_list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="JSON written by cluster.py up")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = json.loads(args.config.read_text())
    LOG.info("provisioner config: %s", cfg)
    Provisioner(cfg).run()


if __name__ == "__main__":
    main()
