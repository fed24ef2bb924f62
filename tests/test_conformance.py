"""The backend conformance suite on the local (bubblewrap) backend and the in-memory fake."""

from __future__ import annotations

from sandpool.core import ResourceLimits
from sandpool.core.backends.local import LocalBackend
from sandpool.core.conformance import CHECKS, check_backend

from .conftest import CALC_IMAGE
from .memory_backend import MemoryBackend


async def test_the_local_backend_passes_every_check(test_images_root, calc_commits):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(disk_bytes=64 * 2**20))
    try:
        report = await check_backend(backend, CALC_IMAGE, kill=backend.kill)
    finally:
        await backend.aclose()
    print(report.render_text())
    assert [r.name for r in report.results] == [name for name, _ in CHECKS]
    assert report.ok, report.failed


async def test_the_suite_fails_a_backend_that_only_pretends():
    # The in-memory backend answers "ok" to everything: a suite that passed it would prove nothing.
    backend = MemoryBackend(head="0" * 40)
    report = await check_backend(backend, "img", kill=lambda sb: setattr(sb, "dead", True))
    print(report.render_text())
    assert not report.ok
    failed = {r.name for r in report.results if r.status == "fail"}
    assert {"exit_codes", "timeout_group", "timeout_escapee", "output_cap", "binary_io", "file_errnos",
            "processes"} <= failed
    assert {r.name: r.status for r in report.results}["disk_quota"] == "skip"
    assert {r.name: r.status for r in report.results}["death"] == "pass"  # it does model death
