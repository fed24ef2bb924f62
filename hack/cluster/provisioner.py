"""Give every pod on the kwok nodes its own working directory and exec target.

Started by ``cluster.py up`` (kwoknodes.py); it watches pods and nodes and, for each pod
bound to a node:

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

Its parts: podfiles.py (the pod's directories, the reaper of deleted pods' processes),
podexec.py (the kwok objects), startdelay.py (the flat start-latency model; imagemodel.py
the seed one). :class:`Provisioner` is the watch loop that drives them.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import podexec
from imagemodel import ImageModel
from kubeapi import ApiError, Kube
from podfiles import PodDirs, Reaper, SourceError
from startdelay import ANN, StartDelays

LOG = logging.getLogger("provisioner")


class Provisioner:
    """Provisions the pods of the cluster at ``cfg["server"]`` (the JSON kwoknodes.py writes)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.pki = Path(cfg["pki"])
        self.server = cfg["server"]
        self.dirs = PodDirs(Path(cfg["root"]))
        self.delays = StartDelays(cfg)
        self.reaper = Reaper()
        self._queues = [queue.Queue() for _ in range(int(cfg.get("workers", 8)))]
        self._done: set[str] = set()  # pod uids provisioned (or given up on)
        self._real_nodes = frozenset(cfg.get("real_nodes", ()))
        # The seed's image conditions (imagemodel.py), or None for the flat pull model.
        self.model = (
            ImageModel(cfg["image_model"], self.dirs.root / "image-model.jsonl")
            if cfg.get("image_model")
            else None
        )

    def kube(self) -> Kube:
        return Kube.from_pki(self.server, self.pki, user_agent="sandpool-provisioner")

    # ---- per pod ---------------------------------------------------------------
    def provision(self, kube: Kube, pod: dict[str, Any]) -> None:
        """Directories, Exec (and PortForward), then the start-latency annotations; a pod
        whose workdir source fails is reported as a kubelet would, never provisioned."""
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        t0 = time.monotonic()
        try:
            workdir = self.dirs.prepare(
                ns, name, uid, (meta.get("annotations") or {}).get(ANN + "workdir-source")
            )
        except SourceError as e:
            self._fail(kube, pod, str(e))
            return
        podexec.apply(kube, podexec.exec_object(pod, workdir))
        if forward := podexec.port_forward_object(pod, workdir):
            podexec.apply(kube, forward)

        if self.model is not None:
            # The pod starts when the model says its images are on the node.
            self.model.acquire(
                pod["spec"]["nodeName"],
                uid,
                list(dict.fromkeys(c["image"] for c in pod["spec"]["containers"])),
                lambda verdict, waited: self._dispatch("READY", pod, (verdict, waited, t0)),
            )
            return
        pull_ms, boot_ms, verdict, new_images = self.delays.for_pod(pod)
        self._mark_provisioned(kube, pod, verdict, pull_ms, boot_ms, t0)
        if new_images:
            self.delays.record(kube, pod["spec"]["nodeName"])

    def _mark_provisioned(
        self, kube: Kube, pod: dict[str, Any], verdict: str, pull_ms: float, boot_ms: float,
        t0: float, waited_s: float | None = None,
    ) -> None:
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        ann = meta.get("annotations") or {}
        workdir = self.dirs.workdir(ns, name)
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
        """Release the pod's images, kill its processes, remove its directories."""
        if self.model is not None and uid is not None:
            self.model.release(uid)
        self.reaper.add(self.dirs.workdir(ns, name))
        self.dirs.remove(ns, name, uid)

    # ---- event plumbing ----------------------------------------------------------
    def _dispatch(self, kind: str, pod: dict[str, Any], extra: Any = None) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        self._queues[hash(key) % len(self._queues)].put((kind, pod, extra))

    def _worker(self, q: queue.Queue) -> None:
        kube = self.kube()
        while True:
            kind, pod, extra = q.get()
            meta = pod["metadata"]
            try:
                if kind == "READY":
                    verdict, waited, t0 = extra
                    boot_ms = self.delays.boot_ms()
                    pull_ms = self.delays.cached_pull_ms()
                    # Retried like a provision: a PATCH lost to a dropped connection would
                    # leave the pod Pending until its client's ready timeout; the merge patch
                    # is idempotent.
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
        for ns, name, uid in self.dirs.stale(live):
            self._dispatch("DELETED", {"metadata": {"namespace": ns, "name": name, "uid": uid}})
        for p in pods:
            self._on_pod("ADDED", p)

    def run(self) -> None:
        for q in self._queues:
            threading.Thread(target=self._worker, args=(q,), daemon=True).start()
        threading.Thread(target=self.reaper.run, daemon=True).start()
        threading.Thread(
            target=self._list_watch,
            args=(
                "/api/v1/nodes",
                lambda _k, n: self.delays.node_event(n),
                lambda ns: [self.delays.node_event(n) for n in ns],
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
