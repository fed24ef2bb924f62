"""Real OCI images built on this machine from Debian packages, for tests and the benchmark.

Built once and cached under ``sandpool_home()/oci-test-images-v<VERSION>/`` (bump
``VERSION`` when what is built changes; old caches are left alone)::

    base.tar      mmdebstrap --variant=minbase bookworm + python3, venv, pip, setuptools,
                  pytest, git (Debian packages; the only step that needs the Debian mirror)
    layout/       an OCI image layout (umoci) with three tags:
      base        that rootfs as one layer; Env PATH, WorkingDir /
      swe         shaped like a SWE-bench image: base + one layer with a git repo at /testbed
                  (package ``calcpkg``, whose ``add`` has a bug), its own venv at
                  /opt/testbed-env with the repo installed (``pip install -e``), ``PATH`` and
                  ``CALC_MODE`` set in the config, WorkingDir /testbed; /etc/issue.net is
                  deleted in that layer (a whiteout made by ``umoci repack``)
      wh          base + a hand-made layer: ``etc/.wh.motd`` (whiteout), ``etc/skel`` made
                  opaque with one new file, a hard-linked pair and a character device node
    swe-task.json the SWE-bench row of the task in ``swe`` (gold patch, FAIL_TO_PASS, ...)

Needs root, ``mmdebstrap``, ``umoci`` and ``bubblewrap`` (Debian packages). First build on
the 2-core test machine: ~2 min for mmdebstrap (download included), ~1 min for the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from sandpool.core.paths import sandpool_home

__all__ = ["SWE_IMAGE", "VERSION", "build_test_images"]

VERSION = "3"
SWE_IMAGE = "sandpool.test/swe-calc:1"
_PACKAGES = "python3,python3-venv,python3-pip,python3-setuptools,python3-pytest,git,ca-certificates"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENV_DIR = "/opt/testbed-env"

_SETUP = "from setuptools import setup\n\nsetup(name='calcpkg', version='1.0', packages=['calcpkg'])\n"
_BUGGY = "def add(a, b):\n    return a - b\n"
_TESTS = ("from calcpkg import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
          "def test_zero():\n    assert add(0, 0) == 0\n")
_PATCH = ("diff --git a/calcpkg/__init__.py b/calcpkg/__init__.py\n--- a/calcpkg/__init__.py\n"
          "+++ b/calcpkg/__init__.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n")

# Runs inside the unpacked swe rootfs (under bubblewrap, as root, no network).
_BUILD_SWE = f"""set -eu
export HOME=/root GIT_AUTHOR_NAME=sandpool GIT_AUTHOR_EMAIL=sandpool@localhost \\
  GIT_COMMITTER_NAME=sandpool GIT_COMMITTER_EMAIL=sandpool@localhost \\
  GIT_AUTHOR_DATE=2000-01-01T00:00:00+0000 GIT_COMMITTER_DATE=2000-01-01T00:00:00+0000
cd /testbed
git init -q -b main && git add -A && git commit -qm base
python3 -m venv --system-site-packages {_ENV_DIR}
{_ENV_DIR}/bin/pip install -q --no-index --no-build-isolation --no-use-pep517 -e /testbed
rm -rf /testbed/calcpkg.egg-info
rm -f /etc/issue.net
# umoci repack rounds mtimes to whole seconds, which makes every .pyc written above stale
# (a .pyc records its source's mtime truncated), so any later import in a sandbox would rewrite
# it and the reset would quarantine. Whole-second mtimes, then fresh .pyc, keep them valid.
find {_ENV_DIR} -exec touch -h -d @946684800 {{}} +
{_ENV_DIR}/bin/python -m compileall -q -f {_ENV_DIR}/lib >/dev/null
"""


def _run(*argv: str | Path, cwd: Path | None = None) -> None:
    res = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv[:4]))} failed: {(res.stderr or res.stdout)[-1500:]}")


def _wh_layer(path: Path) -> None:
    """The hand-made layer: a whiteout, an opaque dir, a hard link and a device node."""
    with tarfile.open(path, "w") as tf:
        def add(name: str, *, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "",
                mode: int = 0o644) -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime, ti.linkname = kind, mode, 946684800, link
            if kind == tarfile.CHRTYPE:
                ti.devmajor, ti.devminor = 1, 3  # what /dev/null is on the host
            ti.size = len(data) if kind == tarfile.REGTYPE else 0
            tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("etc", kind=tarfile.DIRTYPE, mode=0o755)
        add("etc/.wh.motd")
        add("etc/skel", kind=tarfile.DIRTYPE, mode=0o755)
        add("etc/skel/.wh..wh..opq")
        add("etc/skel/only-this", data=b"new\n")
        add("opt", kind=tarfile.DIRTYPE, mode=0o755)
        add("opt/linked-a", data=b"same inode\n")
        add("opt/linked-b", kind=tarfile.LNKTYPE, link="opt/linked-a")
        add("opt/evil-null", kind=tarfile.CHRTYPE, mode=0o666)


def build_test_images(root: Path | None = None) -> Path:
    """Build (or reuse) the test images; return the cache directory (see module docstring).

    Raises:
        RuntimeError: A build step failed (its output is in the message).
    """
    root = Path(root) if root else sandpool_home() / f"oci-test-images-v{VERSION}"
    if (root / ".complete").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").is_file():
            return root
        base_tar = root / "base.tar"
        if not (root / "base.tar.done").is_file():
            # --format=tar: mmdebstrap picks the format from the target's name, and a name
            # not ending in .tar (the temporary one) would make it write a directory.
            _run("mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", f"--include={_PACKAGES}",
                 "bookworm", root / "base.tar.tmp")
            os.replace(root / "base.tar.tmp", base_tar)
            (root / "base.tar.done").touch()
        layout = root / "layout"
        shutil.rmtree(layout, ignore_errors=True)
        lay = str(layout)
        _run("umoci", "init", "--layout", lay)
        _run("umoci", "new", "--image", f"{lay}:base")
        _run("umoci", "raw", "add-layer", "--image", f"{lay}:base", base_tar)
        _run("umoci", "config", "--image", f"{lay}:base", f"--config.env=PATH={_PATH}",
             "--config.workingdir=/")
        bundle = root / "bundle"
        shutil.rmtree(bundle, ignore_errors=True)
        _run("umoci", "unpack", "--image", f"{lay}:base", bundle)
        testbed = bundle / "rootfs" / "testbed"
        for rel, text in (("setup.py", _SETUP), ("calcpkg/__init__.py", _BUGGY),
                          ("tests/test_calc.py", _TESTS), (".gitignore", "__pycache__/\n*.egg-info/\n")):
            (testbed / rel).parent.mkdir(parents=True, exist_ok=True)
            (testbed / rel).write_text(text)
        _run("bwrap", "--bind", bundle / "rootfs", "/", "--proc", "/proc", "--dev", "/dev",
             "--tmpfs", "/tmp", "--unshare-net", "--clearenv", "--setenv", "PATH", _PATH,
             "/bin/sh", "-c", _BUILD_SWE)
        _run("umoci", "repack", "--image", f"{lay}:swe", bundle)
        _run("umoci", "config", "--image", f"{lay}:swe", f"--config.env=PATH={_ENV_DIR}/bin:{_PATH}",
             "--config.env=CALC_MODE=swe", "--config.workingdir=/testbed", "--config.user=root")
        head = subprocess.run(["git", "-c", "safe.directory=*", "-C", bundle / "rootfs" / "testbed",
                               "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        shutil.rmtree(bundle)
        _run("umoci", "tag", "--image", f"{lay}:base", "wh")
        _wh_layer(root / "wh-layer.tar")
        _run("umoci", "raw", "add-layer", "--image", f"{lay}:wh", root / "wh-layer.tar")
        _run("umoci", "gc", "--layout", lay)
        task = {"instance_id": "sandpool__calc-1", "repo": "sandpool/calcpkg", "base_commit": head,
                "image": SWE_IMAGE, "problem_statement": "calcpkg.add(2, 3) returns -1; it must add.",
                "patch": _PATCH, "test_patch": "", "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
                "PASS_TO_PASS": ["tests/test_calc.py::test_zero"]}
        (root / "swe-task.json").write_text(json.dumps(task, indent=2) + "\n")
        with contextlib.suppress(OSError):
            (root / "wh-layer.tar").unlink()
        (root / ".complete").write_text(VERSION)
    return root
