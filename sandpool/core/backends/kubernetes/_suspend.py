"""Suspend and resume of a pod through its agent-sandbox Sandbox's ``spec.operatingMode``.

agent-sandbox (``agents.x-k8s.io/v1beta1`` Sandbox, as of v1.0.3) has ``spec.operatingMode``:
``Running`` (the default) or ``Suspended``. Suspended, its controller deletes the Sandbox's pod
and keeps the Sandbox object (its volumes, and the SandboxClaim that owns it); its status then
has ``Ready=False`` (reason ``SandboxSuspended``) and ``Suspended=True`` (``PodTerminated``),
and the claim mirrors that Ready. Running again, the controller creates a new pod, named like
the Sandbox, from the Sandbox's pod template: nothing of the old pod's processes, memory or
``emptyDir`` volumes comes back. The controller snapshots nothing; saving the state is sandpool's
(the pool's suspend takes a snapshot first, and its resume restores it into the new pod).

:func:`park` and :func:`unpark` are the backend's :meth:`~sandpool.core.base.Backend.park` and
:meth:`~sandpool.core.base.Backend.unpark` in agent-sandbox mode. A plain pod (``mode="pods"``)
has no Sandbox to keep: the pool deletes it instead.
"""

from __future__ import annotations

import asyncio

from sandpool.core.backends.kubernetes._claims import Claims
from sandpool.core.backends.kubernetes._live import LiveSandboxes
from sandpool.core.backends.kubernetes._pods import Pods
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox

__all__ = ["RUNNING", "SUSPENDED", "park", "unpark"]

RUNNING, SUSPENDED = "Running", "Suspended"


async def park(sb: KubernetesSandbox, live: LiveSandboxes, claims: Claims, pods: Pods) -> bool:
    """Close ``sb``'s agent session (the end of its processes), set its Sandbox ``Suspended``
    and return True once the controller deleted its pod; False when ``sb`` has no Sandbox
    object (a plain pod).

    Raises:
        SandboxDied: The Sandbox object is gone.
        InfraTimeout: The pod was not deleted within the backend's ``ready_timeout``.
        ApiError, BackendUnavailable: The patch failed (RBAC needs ``patch`` on ``sandboxes``).
    """
    if sb.sandbox_name is None:
        return False
    # The session closes beside the release: the pod's deletion ends the agent and its
    # stream, so the close need not wait for the agent to exit on its own first.
    closing = asyncio.ensure_future(live.remove(sb, f"suspended: its Sandbox's operatingMode "
                                                    f"is {SUSPENDED}"))
    try:
        await claims.set_operating_mode(sb.sandbox_name, SUSPENDED)
        await pods.wait_gone(sb.pod, sb.pod_uid)
    finally:
        await closing
    return True


async def unpark(sb: KubernetesSandbox, live: LiveSandboxes, claims: Claims,
                 pods: Pods) -> KubernetesSandbox:
    """Set parked ``sb``'s Sandbox ``Running`` and return a sandbox on the controller's new
    pod, with ``sb``'s id, claim, owner and Sandbox, once its agent session (and the backend's
    service) is up. Not recorded pristine yet (the pool does it).

    Raises:
        SandboxDied: The Sandbox object is gone.
        SandboxStartError, InfraTimeout: The new pod did not become Ready.
        ApiError, BackendUnavailable, ExecTransportError: The patch or the session failed.
    """
    name = sb.sandbox_name
    if name is None:
        raise ValueError(f"sandbox {sb.id} has no Sandbox object: it was never parked")
    await claims.set_operating_mode(name, RUNNING)
    pod = await pods.wait_ready(name, replacing=sb.pod_uid)
    fresh = await live.start(sb.image, pod, sb.owner[1], sb.claim, sb.owner)
    fresh.sandbox_name = name
    return fresh
