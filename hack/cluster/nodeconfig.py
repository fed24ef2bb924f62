"""The configuration files of one real node: containerd's and the kubelet's.

Standard library only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from registry import PAUSE_IMAGE

__all__ = ["NODE_TAINT", "RUNTIME_CLASS", "containerd_toml", "kubelet_yaml"]

NODE_TAINT = "sandpool.io/real-node"
RUNTIME_CLASS = ("sandpool-runc", "sandpool-runc")  # (RuntimeClass, containerd handler)


def containerd_toml(node: dict[str, Any]) -> str:
    base = Path(node["base"])
    runc = shutil.which("runc") or "/usr/sbin/runc"
    runtimes = "".join(
        f"""
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.'{h}']
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.'{h}'.options]
        BinaryName = "{runc}"
        Root = "{node['short']}/runc"
        SystemdCgroup = false
"""
        for h in ("runc", RUNTIME_CLASS[1])
    )
    return f"""version = 3
root = "{base / 'containerd'}"
state = "{node['short']}/containerd"

[grpc]
  address = "{node['socket']}"

[ttrpc]
  address = "{node['socket']}.ttrpc"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  netns_mounts_under_state_dir = true
  # This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its oom_score_adj
  # (the kubelet asks -998 for every pod sandbox): keep them at containerd's own.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"{runtimes}
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{base / 'cni' / 'net.d'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{base / 'certs.d'}"

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.internal.v1.opt']
  path = "{base / 'opt'}"
"""


def kubelet_yaml(node: dict[str, Any], pki: Path, ports: dict[str, int], pod_pids: int) -> str:
    base = Path(node["base"])
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{node['cgroup']}
containerRuntimeEndpoint: unix://{node['socket']}
imageServiceEndpoint: unix://{node['socket']}
address: {node['ip']}
port: {ports['kubelet']}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {ports['healthz']}
tlsCertFile: {pki / 'kubelet.crt'}
tlsPrivateKeyFile: {pki / 'kubelet.key'}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {pki / 'ca.crt'}}}
authorization: {{mode: AlwaysAllow}}
failSwapOn: false
podPidsLimit: {pod_pids}
maxPods: 110
registerWithTaints:
- {{key: {NODE_TAINT}, value: "true", effect: NoSchedule}}
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podLogsDir: {base / 'pod-logs'}
volumePluginDir: {base / 'volume-plugins'}
resolvConf: ""
staticPodPath: ""
"""
