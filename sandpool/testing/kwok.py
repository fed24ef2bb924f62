"""The local kwok test cluster (``hack/cluster``) as a Kubernetes backend target.

On kwok a pod's exec is a process on the node host, started in the pod's workdir (the
provisioner's annotation ``sandpool.io/workdir``); nothing here is used on a real cluster.

* :func:`exec_prefix` confines every exec into such a pod: a private mount namespace where
  the pod's workdir is bind-mounted at the image workdir (``/testbed``) and a per-pod
  directory at ``/tmp``, so the in-place reset's ``/tmp`` cleanup touches the pod's own
  ``/tmp``, never the host's. Pass it as ``KubernetesBackend(exec_prefix=exec_prefix)``.
* :func:`local_pack_image_map` runs the local task pack's images on the cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sandpool.core.backends.kubernetes._manifests import HOST_WORKDIR, PodImage

__all__ = ["SETUP", "exec_prefix", "local_pack_image_map"]

#: $1 pod workdir (host path)  $2 image workdir  $3 pod tmp dir  $4 "session" or "exec" (a
#: label only: it names the kind of exec in the host's process list); the rest is the command.
#: Exit 125 with a ``sandpool: `` line when the view cannot be set up (the exec channel reports
#: it as a transport error). The command is exec'd: for a session, started by ``unshare --pid
#: --fork``, the agent itself becomes pid 1 of its pid namespace, as under the local backend's
#: ``bwrap --as-pid-1``. The kernel then drops every signal a process of the namespace sends it
#: that it has no handler for (SIGKILL and SIGSTOP included, root or not), so a policy's
#: ``kill -9 -1`` or ``kill -9 1`` cannot end the session; the agent reaps the orphans its
#: commands leave, and when it ends every process of the namespace dies with it.
SETUP = r"""
{ [ -d "$2" ] || mkdir -p "$2"; } && { [ -d "$3" ] || mkdir -p "$3"; } \
  && mount --bind "$1" "$2" && mount --bind "$3" /tmp \
  || { echo "sandpool: cannot set up the pod's filesystem view" >&2; exit 125; }
shift 4
exec "$@"
"""


def exec_prefix(pod: Mapping[str, Any], workdir: str, session: bool = False) -> list[str]:
    """The argv prefix confining an exec into kwok pod ``pod`` whose image workdir is ``workdir``.

    Args:
        pod: The Ready pod object (its ``sandpool.io/workdir`` annotation).
        workdir: The image workdir the pod's directory is mounted at.
        session: True for the long-lived agent session: it also gets its own pid namespace
            (and ``/proc``), so the agent's process listing and kills see only the pod's
            processes, never the host's. Per-command execs stay in the host's pid
            namespace, where the exec wrapper finds a sandbox's processes by its marker.

    Returns:
        ``unshare --mount ... /bin/sh -c SETUP sandpool-kwok <host wd> <workdir> <host tmp>
        <mode>``; the exec's own argv follows it.

    Raises:
        KeyError: The pod has no ``sandpool.io/workdir`` annotation (it is not a kwok pod
            provisioned by ``hack/cluster/provisioner.py``).
    """
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    host_wd = ann.get(HOST_WORKDIR)
    if not host_wd:
        raise KeyError(f"the pod has no {HOST_WORKDIR} annotation (not a kwok test-cluster pod)")
    ns = ["--pid", "--fork", "--mount-proc"] if session else []
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        *ns,
        "--",
        "/bin/sh",
        "-c",
        SETUP,
        "sandpool-kwok",
        host_wd,
        workdir,
        # Next to the workdir, not in it: git never sees it and a reset that restores .git
        # keeps it; the provisioner removes it with the workdir.
        f"{host_wd.rstrip('/')}.tmp",
        "session" if session else "exec",
    ]


def local_pack_image_map(images_root: Path | str | None = None) -> Callable[[str], PodImage]:
    """The image map that runs the local task pack's images on the local (kwok) cluster.

    Task image ``name`` becomes ``PodImage(image=name, workdir_source=<its repo dir>)``, with
    the image's venv on ``PATH``: ``<images_root>/<safe name>/image.json`` (the local
    backend's image directory, :func:`sandpool.core.backends.local.image_dir`) gives the
    repo the cluster copies into each pod's workdir, so the same tasks run on both backends.
    The image name itself is only a label on kwok (nothing is pulled).

    Raises (when called):
        ImageNotFound: The image directory is missing or malformed.
    """
    from sandpool.core.backends.local import LocalBackend

    local = LocalBackend(images_root)

    def resolve(name: str) -> PodImage:
        img = local.image(name)
        return PodImage(
            image=name,
            workdir=img.workdir,
            workdir_source=img.repo,
            head=img.head,
            env={
                "VIRTUAL_ENV": img.venv,
                "PATH": f"{img.venv}/bin:/usr/local/bin:/usr/bin:/bin",
                "HOME": "/tmp",
                "LANG": "C.UTF-8",
                "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_AUTHOR_NAME": "sandbox",
                "GIT_AUTHOR_EMAIL": "sandbox@localhost",
                "GIT_COMMITTER_NAME": "sandbox",
                "GIT_COMMITTER_EMAIL": "sandbox@localhost",
            },
        )

    return resolve
