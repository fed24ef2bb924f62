"""An OCI sandbox's repo overlay as a hostile policy would use it, on real bubblewrap sandboxes.

The repo (/testbed) is an overlay of its own, slave of a shared host mount point; a fork
stacks the snapshot's layer read-only under each child's upper. The policy, root in its user
namespace, tries to reach below its upper layer (unmount, a new namespace, a bind, a hard
link, a rename across mounts, the overlay's lower paths from ``/proc/self/mountinfo``) and
then looks for what survived: in a sibling, in the parent, in the snapshot's layer and after
the reset.
"""

from __future__ import annotations

import os

from sandpool.core import PoolLimits, SandboxPool
from sandpool.core.backends.local import LocalBackend

#: Each escape attempt; each must fail (exit non-zero) or leave a write only in the sandbox's
#: own upper layer. Printed as ``name=<exit>``.
_ATTEMPTS = {
    "umount": "umount -l /testbed",
    "unshare": "unshare -Urm true",
    "unshare-m": "unshare -m true",
    "bind": "mount --bind /tmp /testbed",
    "remount-rw": "mount -o remount,rw /testbed",
    # The host paths of the overlays' lower layers (the image's own /usr is not one of them).
    "lowerdir": ("for d in $(grep -o 'lowerdir=[^, ]*' /proc/self/mountinfo | cut -d= -f2 | tr : ' ');"
                 " do [ \"$d\" = /usr ] && continue; mkdir -p \"$d\" 2>/dev/null;"
                 " echo TOKEN-X > \"$d/escape.txt\" 2>/dev/null && ! grep -rqs TOKEN-X /testbed && exit 0;"
                 " done; exit 1"),
    # The host's /usr and Python, mounted for the agent (overlays with host lower layers).
    "agent-mounts": ("echo TOKEN-X > /.sandpool/usr/escape.txt || echo TOKEN-X > /.sandpool/python/escape.txt"
                     " || echo TOKEN-X > /.sandpool/agent.py"),
    "hardlink": "ln shared.txt /tmp/hl && echo TOKEN-X >> /tmp/hl && rm /tmp/hl",
    "rename": "echo TOKEN-X > /root/mv.txt && mv /root/mv.txt /testbed/mv.txt",
    "setuid": "cp /bin/sh sh-suid && chmod 4755 sh-suid",
    "hook": "mkdir -p .git/hooks && printf '#!/bin/sh\\necho TOKEN-X > /tmp/hooked\\n' > .git/hooks/post-checkout"
            " && chmod +x .git/hooks/post-checkout",
}
_LOOK = "grep -rsl TOKEN-X /testbed /tmp /dev/shm /root 2>/dev/null; cat shared.txt"


async def test_a_fork_child_cannot_reach_a_siblings_the_parents_or_the_layers_repo(
        test_images_root, oci_store, swe_task):
    backend = LocalBackend(test_images_root, store=oci_store)
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=6)) as pool:
        async with pool.claim(swe_task) as parent:
            assert (await parent.exec("echo shared > shared.txt")).ok
            a, b = await parent.fork(2)
            try:
                script = "; ".join(f"( {cmd} ) >/dev/null 2>&1; echo {name}=$?" for name, cmd in _ATTEMPTS.items())
                res = await a.exec(script, timeout=60)
                codes = dict(line.split("=", 1) for line in res.text.split())
                for name in ("umount", "unshare", "unshare-m", "bind", "remount-rw", "agent-mounts"):
                    assert codes[name] != "0", (name, res.text)  # no capability, no nested userns
                # Whatever a wrote landed in its own upper layer: no one else sees it.
                for other in (b, parent):
                    seen = await other.exec(_LOOK, timeout=30)
                    assert seen.text == "shared\n", (other, seen)
                    assert (await other.exec("test ! -e sh-suid && test ! -e .git/hooks/post-checkout")).ok
                snap = a.restored_from
                (layer,) = [snap.location / p for p in snap.parts if p.startswith("layers/")]
                assert (layer / "shared.txt").read_text() == "shared\n"
                # The lower layers' host paths the sandbox read in its mountinfo: untouched (a
                # path of the same name inside is the sandbox's own root).
                lowers = (await a.exec("grep -o 'lowerdir=[^, ]*' /proc/self/mountinfo | cut -d= -f2 | tr : '\\n'")).text.split()
                assert lowers and not [d for d in lowers if os.path.lexists(f"{d}/escape.txt")]
                assert not any("TOKEN-X" in p.read_text(errors="replace") for p in layer.rglob("*")
                               if p.is_file() and not p.is_symlink())
                # The reset: nothing of a's survives, and its planted hook never ran.
                await a.reset()
                after = await a.exec(_LOOK + "; ls -a /tmp; test ! -e sh-suid && echo clean", timeout=30)
                assert "TOKEN-X" not in after.text and "hooked" not in after.text and "clean" in after.text, after
            finally:
                await a.release()
                await b.release()
