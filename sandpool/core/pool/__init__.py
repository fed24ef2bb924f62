"""The sandbox pool: warm pools per image, millisecond claims, in-place reuse.

* :mod:`~sandpool.core.pool.pool`: :class:`SandboxPool`: open and close, prepare, claim and
  release, a lease's reset, the run report;
* :mod:`~sandpool.core.pool.claims`: the claim path: a live sandbox at the task's commit for
  a claim, and a held lease's in-place reset or swap to a fresh sandbox;
* :mod:`~sandpool.core.pool.entries`: what the pool holds, as entries in per-state
  collections per image, and the one place they change and decisions are made;
* :mod:`~sandpool.core.pool.worker`: the creations, resets and deletes decided there, each
  in a task, reporting back;
* :mod:`~sandpool.core.pool.lease`: :class:`Lease`, a claimed sandbox;
* :mod:`~sandpool.core.pool.snapshots`: claims restored from a snapshot, fork, suspend and
  resume of a lease;
* :mod:`~sandpool.core.pool.batch`: a batch's claims announced up front, and the warm pools a
  backend holds sized to them;
* :mod:`~sandpool.core.pool.limits`: :class:`PoolLimits` and the pool's lifecycle;
* :mod:`~sandpool.core.pool.report`: the run report from the pool's counters.
"""

from sandpool.core.pool.lease import Lease
from sandpool.core.pool.limits import PoolLimits, PoolState
from sandpool.core.pool.pool import SandboxPool

__all__ = ["Lease", "PoolLimits", "PoolState", "SandboxPool"]
