"""Local sandboxes: a bubblewrap process tree per sandbox, the embedded default backend.

Each sandbox is one long-lived agent process (``_agent.py``) under bubblewrap:

* no network (``--unshare-all``; ``ResourceLimits.network`` shares it back), its own pid,
  ipc, uts, user and cgroup namespaces, ``--die-with-parent``, ``--new-session``, and no
  nested user namespaces;
* root inside is no one outside, and no one of another sandbox: the user namespace maps onto
  a range of unprivileged host ids of its own (``_idrange``: uid 1000 inside is host uid
  ``BASE + 1000``; ``_idmap``), bubblewrap itself runs as that uid, and the image's files are
  seen through idmapped mounts in that range; so what a rollout writes, setuid bits included,
  belongs to no host user, and no per-user kernel object (inotify instances, pipe pages,
  message queue bytes) is shared with a concurrent sandbox;
* a read-only view of the host's ``/usr`` (the toolchain), the image's interpreter and venv,
  and nothing of the host's home, work trees or environment (``--clearenv``);
* the image's repo at ``/testbed`` as an overlayfs whose upper layer is private to the
  sandbox (copy-on-write, not a copy), the image's repo itself read-only at
  ``/opt/sandpool/image`` (the in-place reset's restore source), a private ``/tmp`` and
  ``/dev/shm``, a private mqueue at ``/dev/mqueue``, and nothing else writable;
* a seccomp filter (:mod:`sandpool.core.agent.seccomp`): no kernel keyring is reachable (keys are not namespaced,
  so one would carry state to the next rollout and to concurrent sandboxes), and no process
  may set another's resource limits (the agent's included);
* CPU, memory and pid limits from its own cgroup, joined before bubblewrap starts; its
  commands run one level down (``_cgroup``), so a fork or memory bomb cannot starve the agent;
  an agent's death is the policy's (``SandboxExhausted``) only when the kernel counted that
  group's own budget spent (``_cgroup.BudgetWatch``), else infra (``SandboxDied``);
* a disk quota (``ResourceLimits.disk_bytes``): the overlay's upper layer and ``/tmp`` live on
  a per-sandbox loop-mounted filesystem of that size (``_quota``), so a rollout that writes too
  much gets ENOSPC inside its sandbox (``write_file`` raises :class:`DiskQuotaExceeded`) and
  the host disk is never filled; the sandbox stays usable and the in-place reset frees it;
* optionally one long-lived service process per sandbox (:class:`ServiceSpec`, e.g. an
  agent-server), started while the sandbox is created, with a writable directory of its own
  at :data:`SERVICE_DIR` (outside the repo and the scratch directories); ``ps`` and
  ``kill_strays``, and so in-place reset, leave it running (image directories only).

OCI images hydrated into the image store (``sandpool images pull``, :mod:`sandpool.core.images`)
are started the same way with their own root filesystem as ``/`` and root inside mapped to an
unprivileged host uid, their repo an overlay of its own as an image directory's is; see
``_oci``. A name is looked up as an image directory first, then in
the image store.

An image is a directory ``<images_root>/<safe-name>/`` holding ``image.json``, ``repo/`` and
``venv/`` (see :class:`LocalImage`); building one is hydration, done before rollouts ask.
Overlay mounts need root (``CAP_SYS_ADMIN``); :meth:`LocalBackend.preflight` says so plainly.

The package: :mod:`.backend` (:class:`LocalBackend`: images, the start sequence, deletion),
:mod:`.sandbox` (:class:`LocalSandbox`: the agent's channel, in-place restore),
:mod:`._bwrap` (the bubblewrap argv and what a sandbox sees where), :mod:`.image` (image
directories), ``_layout`` (a sandbox's directories and mounts on the host), ``_cleanup``
(unmounting a sandbox, reaping dead runs), ``_fresh`` (the reset's fresh layers), ``_snapshot``
(snapshots, restores and forks), and the host-side helpers ``_oci``, ``_idmap``,
``_idrange``, ``_overlay``, ``_quota`` and ``_cgroup``. The agent,
its channel and its seccomp filter are :mod:`sandpool.core.agent`'s.
"""

from sandpool.core.backends.local._bwrap import SERVICE_DIR
from sandpool.core.backends.local._cleanup import reap_stale
from sandpool.core.backends.local.backend import LocalBackend
from sandpool.core.backends.local.image import LocalImage, image_dir
from sandpool.core.backends.local.sandbox import LocalSandbox
from sandpool.core.service import ServiceSpec

__all__ = ["SERVICE_DIR", "LocalBackend", "LocalImage", "LocalSandbox", "ServiceSpec", "image_dir",
           "reap_stale"]
