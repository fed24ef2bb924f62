"""The ports servers in tests and hack/cluster listen on: never ones the kernel hands to clients."""

import sys
from pathlib import Path

from tests.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack" / "cluster"))
from procs import _ephemeral_range


def test_ports_are_drawn_outside_the_ephemeral_range_and_never_twice() -> None:
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if lo <= p <= hi]

