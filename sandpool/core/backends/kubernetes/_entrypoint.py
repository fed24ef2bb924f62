"""The agent as its container's pid 1, reached over the ``attach`` subresource.

On a real cluster a pod exec joins the container's pid namespace as an ordinary process, so
an agent started by exec could be killed by the policy's ``kill -9 -1``, ending its channel
(an infra retry the policy caused). Instead the container's command is :data:`BOOT`: it
becomes the agent itself, pid 1 of the container, whose stdin and stdout are held by the
container runtime, not by any process inside. The kernel drops every signal sent to a pid
namespace's init from inside that it has no handler for (SIGKILL and SIGSTOP included, root
or not), so ``kill -9 1`` and ``kill -9 -1`` leave it answering; it reaps the orphans its
commands leave. No capability is needed (no ``unshare``).

The boot waits for one attach (``stdin: true, stdinOnce: true``): the host sends
``<length>\\n<agent source>``, the boot ``exec``s it, and the agent says it is ready. When the
attach ends, the container's stdin closes, the agent reads EOF and exits: the sandbox ends
with its channel, as an exec'd agent's does. Everything the agent writes on stdout is also in
the container's log (the runtime copies it there; the kubelet rotates it).

An image with no usable interpreter (:data:`MIN_PYTHON` with ``ctypes``, which the agent
needs to make itself non-dumpable) answers the attach with ``{"id": 0, "ready": false,
"error": ...}`` and then sleeps, so its sandboxes fall back to one pod exec per command and
the backend says why.
"""

from __future__ import annotations

from sandpool.core.agent.client import agent_source

__all__ = ["BOOT", "MIN_PYTHON", "boot_payload", "entrypoint"]

#: The oldest Python 3 the agent runs on (SWE-bench's images ship 3.6 and later).
MIN_PYTHON = (3, 6)
_V = f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
#: ``sh -c BOOT <python>``: pid 1 of a sandbox's container.
BOOT = f"""\
if "$0" -c 'import ctypes, sys; sys.exit(sys.version_info < {MIN_PYTHON!r})' >/dev/null 2>&1; then
  exec "$0" -I -u -c 'import sys; n = int(sys.stdin.buffer.readline()); \
exec(compile(sys.stdin.buffer.read(n), "sandpool-agent", "exec"))'
fi
read -r _
printf '{{"id": 0, "ready": false, "error": "the image has no %s >= {_V} with ctypes for the \
sandpool agent"}}\\n' "$0"
cat >/dev/null
exec sleep infinity
"""


def entrypoint(python: str) -> list[str]:
    """The container command that makes the agent (run by ``python``) the container's pid 1."""
    return ["/bin/sh", "-c", BOOT, python]


def boot_payload() -> bytes:
    """What the host sends first on the attach stream: the agent's source, length-prefixed."""
    src = agent_source().encode()
    return b"%d\n" % len(src) + src
