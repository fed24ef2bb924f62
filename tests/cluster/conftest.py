"""Fixtures for tests against the local Kubernetes cluster (hack/cluster/).

Tests opt in with ``@pytest.mark.cluster``. The session fixture ``cluster`` builds the
binaries if needed (the first build compiles Kubernetes: tens of minutes), starts the
cluster in its own run directory, yields a :class:`ClusterInfo`, and stops it.
Set ``SANDPOOL_CLUSTER_REUSE=1`` to use (and leave running) a cluster already started
with ``python3 hack/cluster/cluster.py up``.

The Python client is the official ``kubernetes`` package: it is synchronous (no
event-loop scoping for a session fixture) and has the ``stream`` helper for pod exec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream

REPO = Path(__file__).resolve().parents[2]
CLUSTER_PY = REPO / "hack" / "cluster" / "cluster.py"
NODEBUILD_PY = REPO / "hack" / "cluster" / "nodebuild.py"
# The cluster's stdlib modules (cluster_faults: kill and restart its components) for the tests.
sys.path.insert(0, str(CLUSTER_PY.parent))
RUN_ID = uuid.uuid4().hex[:8]
RUN_ID_LABEL = "sandpool.io/run-id"


BUILD_TIMEOUT_S = 3600  # a first build compiles Kubernetes: about 20-30 min on 2 cores


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cluster: needs the local Kubernetes cluster from hack/cluster (slow first build)",
    )
    config.addinivalue_line(
        "markers",
        "real_node: needs a real node (kubelet, containerd, runc) in that cluster; the session's "
        "cluster then starts one (`up --real-nodes 1`)",
    )


_WANT_REAL_NODE = False  # set at collection: some selected test runs on a real node


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the first cluster test, whose setup may build the binaries, a build-sized timeout.

    Only when pytest-timeout is active and the binaries are not built yet; running
    ``python3 hack/cluster/cluster.py build`` before pytest avoids this entirely.
    """
    global _WANT_REAL_NODE
    _WANT_REAL_NODE = any(item.get_closest_marker("real_node") for item in items)
    if (
        not config.pluginmanager.hasplugin("timeout")
        or os.environ.get("SANDPOOL_CLUSTER_REUSE") == "1"
    ):
        return
    first = next((item for item in items if item.get_closest_marker("cluster")), None)
    if first is None:
        return
    checks = [[str(CLUSTER_PY), "build", "--check"]]
    if _WANT_REAL_NODE:
        checks.append([str(NODEBUILD_PY), "--check"])
    for argv in checks:
        if subprocess.run([sys.executable, *argv], check=False, capture_output=True).returncode:
            first.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))
            break


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """A running cluster: where its kubeconfig is, and a client for it."""

    kubeconfig: Path
    api_client: client.ApiClient
    run_dir: Path
    run_id: str

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


def _cluster_cmd(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, str(CLUSTER_PY), *args], check=True, env=env)


def _cache_base() -> Path:
    return Path(
        os.environ.get("SANDPOOL_CLUSTER_CACHE") or Path.home() / ".cache" / "sandpool" / "cluster"
    )


def _reap_orphaned_runs(root: Path, env: dict[str, str]) -> None:
    """Stop and remove clusters of earlier pytest sessions whose process is gone."""
    for run in root.glob("*/owner.pid") if root.exists() else []:
        if Path(f"/proc/{run.read_text().strip()}").exists():
            continue  # a concurrent session: leave it alone
        _cluster_cmd("down", env=dict(env, SANDPOOL_CLUSTER_RUN_DIR=str(run.parent)))
        shutil.rmtree(run.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterInfo]:
    env = dict(os.environ)
    reuse = os.environ.get("SANDPOOL_CLUSTER_REUSE") == "1"
    if reuse:
        run_dir = Path(env.get("SANDPOOL_CLUSTER_RUN_DIR") or _cache_base() / "run")
    else:
        # A run directory per session, so neither a developer's cluster nor a
        # concurrent session is touched.
        root = _cache_base() / "pytest"
        _reap_orphaned_runs(root, env)
        run_dir = root / RUN_ID
        run_dir.mkdir(parents=True)
        (run_dir / "owner.pid").write_text(str(os.getpid()))
        env["SANDPOOL_CLUSTER_RUN_DIR"] = str(run_dir)
        env.pop("SANDPOOL_CLUSTER_KUBECONFIG", None)
        _cluster_cmd("up", *(["--real-nodes", "1"] if _WANT_REAL_NODE else []), env=env)
    state = json.loads((run_dir / "state.json").read_text())
    kubeconfig = Path(state["kubeconfig"])
    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield ClusterInfo(
            kubeconfig=kubeconfig, api_client=api_client, run_dir=run_dir, run_id=RUN_ID
        )
    finally:
        api_client.close()
        if not reuse:
            _cluster_cmd("down", env=env)
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def namespace(cluster: ClusterInfo, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, labelled with the run id; deleted afterwards."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:32].strip("-")
    # A digest of the full name keeps parametrized variants (same prefix) apart.
    digest = hashlib.sha256(request.node.name.encode()).hexdigest()[:6]
    name = f"t-{RUN_ID}-{slug}-{digest}"
    core = cluster.core
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={RUN_ID_LABEL: RUN_ID}))
    )
    # Pods are admitted only once the controller-manager made the default service account.
    wait_until(
        lambda: _exists(lambda: core.read_namespaced_service_account("default", name)),
        30,
        "default SA",
    )
    try:
        yield name
    finally:
        core.delete_namespace(name)


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Poll ``check`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


_EXIT_STATUS = re.compile(r": exit status (\d+)$")  # the end of kwok's message


def pod_exec(
    cluster: ClusterInfo, namespace: str, pod: str, command: list[str], timeout: float = 60
) -> ExecResult:
    """Run ``command`` in ``pod`` through the API's exec subresource.

    The exit code comes from the status channel: ``Success`` is 0; kwok 0.8.0 reports a
    non-zero exit as a failure whose message ends in ``: exit status N`` (it does not fill
    the ``ExitCode`` cause), so both forms are read. Anything else (command not found,
    killed by a signal, transport errors) raises.
    """
    resp = stream(
        cluster.core.connect_get_namespaced_pod_exec,
        pod,
        namespace,
        command=command,
        stdout=True,
        stderr=True,
        stdin=False,
        tty=False,
        _preload_content=False,
    )
    out, err = [], []
    deadline = time.monotonic() + timeout
    try:
        while resp.is_open():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"exec {command} in {namespace}/{pod} did not finish in {timeout} s"
                )
            resp.update(timeout=1)
            if resp.peek_stdout():
                out.append(resp.read_stdout())
            if resp.peek_stderr():
                err.append(resp.read_stderr())
        status = yaml.safe_load(resp.read_channel(3) or "{}") or {}
    finally:
        resp.close()
        if resp.sock is not None:  # close() leaves the socket open once the server has closed it
            resp.sock.shutdown()
    if status.get("status") == "Success":
        code = 0
    else:
        causes = (status.get("details") or {}).get("causes") or []
        codes = [c.get("message") for c in causes if c.get("reason") == "ExitCode"]
        match = _EXIT_STATUS.search(status.get("message", ""))
        if codes:
            code = int(codes[0])
        elif match:
            code = int(match.group(1))
        else:
            raise RuntimeError(f"exec {command} in {namespace}/{pod} failed: {status}")
    return ExecResult(code, "".join(out), "".join(err))


@pytest.fixture
def exec_in_pod(cluster: ClusterInfo) -> Callable[..., ExecResult]:
    """``exec_in_pod(namespace, pod, ["git", "status"]) -> ExecResult``."""
    return lambda namespace, pod, command, timeout=60: pod_exec(
        cluster, namespace, pod, command, timeout
    )


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """``wait_for(check, timeout_s, "what")``: poll until ``check()`` is truthy."""
    return wait_until


# ---- real nodes ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RealNode:
    """A real node of the session's cluster (``hack/cluster/realnode.py``) and its registry.

    ``node_selector`` and ``tolerations`` put a pod there (the node is tainted so that kwok
    keeps every other pod); ``push(source, image)`` copies an image (any skopeo source) to the
    run's registry as ``sandpool.test/...``, which the node pulls from.
    """

    name: str
    registry: str
    run_dir: Path
    state: dict

    node_selector: dict = dataclasses.field(default_factory=lambda: {"sandpool.io/node": "real"})
    tolerations: tuple = (
        {"key": "sandpool.io/real-node", "operator": "Exists", "effect": "NoSchedule"},
    )
    runtime_class: str = "sandpool-runc"  # a RuntimeClass whose handler is runc

    def push(self, source: str, image: str) -> None:
        env = dict(os.environ, SANDPOOL_CLUSTER_RUN_DIR=str(self.run_dir))
        _cluster_cmd("push", source, image, env=env)

    def crictl(self, *args: str) -> subprocess.CompletedProcess:
        """Run crictl against the node's containerd (the CRI the kubelet uses)."""
        from nodebuild import node_build_dir

        ep = f"unix://{self.state['real_nodes'][0]['socket']}"
        return subprocess.run([str(node_build_dir() / "bin" / "crictl"), "--runtime-endpoint", ep,
                               "--image-endpoint", ep, *args], capture_output=True, text=True,
                              check=False)


@pytest.fixture(scope="session")
def real_node(cluster: ClusterInfo) -> RealNode:
    """The cluster's first real node; fails (never skips) when the cluster has none, e.g. a
    ``SANDPOOL_CLUSTER_REUSE=1`` cluster started without ``--real-nodes``."""
    state = json.loads((cluster.run_dir / "state.json").read_text())
    if not state.get("real_nodes"):
        pytest.fail("the cluster has no real node: start it with `cluster.py up --real-nodes 1`")
    return RealNode(state["real_nodes"][0]["name"], state["registry"], cluster.run_dir, state)


@pytest.fixture(scope="session")
def real_images(real_node: RealNode) -> dict[str, str]:
    """The SWE-bench-shaped OCI test images (``sandpool.envs.taskpack.oci``) in the node's
    registry: ``{"swe": "sandpool.test/swe-calc:1", "base": ..., "task": <swe-task.json path>}``."""
    from sandpool.envs.taskpack.oci import SWE_IMAGE, build_test_images

    root = build_test_images()
    images = {"swe": SWE_IMAGE, "base": "sandpool.test/base:1"}
    for tag, image in images.items():
        real_node.push(f"oci:{root / 'layout'}:{tag}", image)
    return {**images, "task": str(root / "swe-task.json")}


_OLD_PYTHONS = ("3.6.15", "2.7.18")  # pyenv's, on the machine; the image gets them at the same path


@pytest.fixture(scope="session")
def old_python_image(real_node: RealNode, real_images: dict[str, str], tmp_path_factory) -> dict:
    """``sandpool.test/oldpython:1``: the SWE-shaped test image with its own ``python3``
    removed (whiteouts) and pyenv's Python 3.6 and 2.7 added at their host paths.

    Returns ``{"image", "python36", "python27"}`` (interpreter paths inside the image).
    Fails (never skips) when the machine lacks those pyenv versions.
    """
    import tarfile

    from sandpool.envs.taskpack.oci import build_test_images

    prefixes = [Path.home() / ".pyenv" / "versions" / v for v in _OLD_PYTHONS]
    if missing := [str(p) for p in prefixes if not (p / "bin").is_dir()]:
        pytest.fail(f"the old-Python image needs pyenv's {missing} on this machine")
    work = tmp_path_factory.mktemp("oldpython")
    lay = work / "layout"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{build_test_images() / 'layout'}:swe",
                    f"oci:{lay}:old"], check=True)
    skip = ("/test/", "/site-packages/", "/idlelib/", "/tkinter/", "/lib2to3/", "/ensurepip/")

    def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if any(s in f"/{ti.name}/" for s in skip) or ti.name.endswith(".a"):
            return None
        ti.uid = ti.gid = 0
        return ti

    layer = work / "pythons.tar"
    with tarfile.open(layer, "w") as tar:
        for p in prefixes:
            tar.add(p, arcname=str(p).lstrip("/"), filter=keep)
        for name in ("usr/bin/.wh.python3", "usr/bin/.wh.python3.11"):
            tar.addfile(tarfile.TarInfo(name))
    subprocess.run(["umoci", "raw", "add-layer", "--image", f"{lay}:old", str(layer)], check=True)
    image = "sandpool.test/oldpython:1"
    real_node.push(f"oci:{lay}:old", image)
    return {"image": image, "python36": f"{prefixes[0]}/bin/python3.6",
            "python27": f"{prefixes[1]}/bin/python2.7"}
