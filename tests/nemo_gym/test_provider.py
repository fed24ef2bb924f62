"""The ``sandpool`` sandbox provider, looked up and driven through NeMo Gym's own sandbox API."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from nemo_gym.sandbox import (
    AsyncSandbox,
    Sandbox,
    SandboxSpec,
    SandboxStatus,
    create_provider,
    get_provider_class,
    list_providers,
    resolve_provider_config,
)
from sandpool.core import errors
from sandpool.core.task import Task
from sandpool.integrations.nemo_gym.provider import SandpoolProvider


def test_provider_is_published_under_the_entry_point_group() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="nemo_gym.sandbox_providers")}
    assert names.get("sandpool") == "sandpool.integrations.nemo_gym.provider:SandpoolProvider", (
        "add to pyproject.toml: [project.entry-points.\"nemo_gym.sandbox_providers\"] "
        "sandpool = \"sandpool.integrations.nemo_gym.provider:SandpoolProvider\", then reinstall")
    assert "sandpool" in list_providers()
    assert get_provider_class("sandpool") is SandpoolProvider


async def test_async_round_trip_through_the_registry(pool_block: dict[str, Any], calc_task: Task,
                                                     tmp_path: Path) -> None:
    named = {"sandbox": {"sandpool": pool_block | {"linger_s": 0}}}  # as an agent config names it
    spec = SandboxSpec(metadata={"instance_id": calc_task.instance_id}, ready_timeout_s=60)
    src = tmp_path / "in.txt"
    src.write_bytes("héllo\n".encode())
    async with AsyncSandbox(resolve_provider_config("sandbox", named), spec) as sb:
        await sb.start()
        assert await sb.status() == SandboxStatus.RUNNING
        head = await sb.exec("git rev-parse HEAD", timeout_s=30)
        assert (head.return_code, head.stdout.strip()) == (0, calc_task.base_commit)
        await sb.upload(src, "/tmp/up/in.txt")
        cat = await sb.exec("cat /tmp/up/in.txt && echo err >&2 && exit 4")
        assert (cat.return_code, cat.stdout, cat.stderr) == (4, "héllo\n", "err\n")
        slow = await sb.exec("sleep 20", timeout_s=1)
        assert slow.return_code == 124 and slow.error_type == "timeout"
        await sb.exec("echo made in sandbox > out.txt")
        await sb.download("out.txt", tmp_path / "down" / "out.txt")
        assert (tmp_path / "down" / "out.txt").read_text() == "made in sandbox\n"
    assert await sb.status() == SandboxStatus.STOPPED


def test_sync_round_trip_through_the_registry(pool_block: dict[str, Any], calc_task: Task,
                                              tmp_path: Path) -> None:
    src = tmp_path / "a.py"
    src.write_text("print(6 * 7)\n")
    with Sandbox({"sandpool": pool_block}, SandboxSpec(image=calc_task.image)) as sb:
        sb.start()
        sb.upload(src, "a.py")
        res = sb.exec("python a.py")
        assert (res.return_code, res.stdout) == (0, "42\n")
        sb.download("calc.py", tmp_path / "calc.py")
        assert "a - b" in (tmp_path / "calc.py").read_text()
        assert sb.status() == SandboxStatus.RUNNING
    assert sb.status() == SandboxStatus.STOPPED


async def test_released_sandbox_is_reset_and_reused(pool_block: dict[str, Any], calc_task: Task) -> None:
    provider = create_provider({"sandpool": pool_block | {"concurrency": 1, "linger_s": 0}})
    spec = SandboxSpec(metadata={"instance_id": calc_task.instance_id})
    first = await provider.create(spec)
    await provider.exec(first, "echo dirty > calc.py && touch new.txt")
    await provider.close(first)
    second = await provider.create(spec)
    res = await provider.exec(second, "git status --porcelain; cat calc.py")
    assert "a - b" in res.stdout and "new.txt" not in res.stdout
    assert second.sandbox_id == first.sandbox_id  # the same sandbox, reset in place
    await provider.aclose()



async def test_a_tool_timeout_that_is_no_number_of_seconds_runs_the_command(
        pool_block: dict[str, Any], calc_task: Task) -> None:
    # A tool call's timeout is the policy's: NaN once reached the agent and came back as no
    # answer within NaN s (infra, unscored). Now none, 0, NaN, a negative number, inf: each
    # runs the command, under exec_timeout_s or at most max_exec_timeout_s.
    provider = create_provider({"sandpool": pool_block | {"linger_s": 0, "exec_timeout_s": 30,
                                                          "max_exec_timeout_s": 60}})
    handle = await provider.create(SandboxSpec(metadata={"instance_id": calc_task.instance_id}))
    for asked in (None, 0, float("nan"), -5.0, float("inf"), float("-inf")):
        res = await provider.exec(handle, "echo ran", timeout_s=asked)
        assert (res.stdout, res.return_code, res.error_type) == ("ran\n", 0, None), asked
    settings = provider.settings
    assert [settings.tool_timeout(t) for t in (None, float("nan"), -1, 5, float("inf"))] == [30, 30, 30, 5, 60]
    await provider.close(handle)
    await provider.aclose()

async def test_killed_sandbox_raises_infra_error_and_reports_error_status(
        pool_block: dict[str, Any], calc_task: Task) -> None:
    provider = create_provider({"sandpool": pool_block | {"linger_s": 0}})
    handle = await provider.create(SandboxSpec(metadata={"instance_id": calc_task.instance_id}))
    provider.pool.backend.kill(handle.raw.sandbox)
    with pytest.raises(errors.InfraError):
        await provider.exec(handle, "true")
    assert await provider.status(handle) == SandboxStatus.ERROR
    await provider.close(handle)
    assert await provider.status(handle) == SandboxStatus.STOPPED
    await provider.aclose()


def test_bad_provider_settings_name_the_key(pool_block: dict[str, Any]) -> None:
    with pytest.raises(errors.ConfigError, match=r"sandpool\.strategy"):
        create_provider({"sandpool": pool_block | {"strategy": "fast"}})
    with pytest.raises(errors.ConfigError, match=r"sandpool\.concurency"):
        create_provider({"sandpool": pool_block | {"concurency": 4}})


async def test_spec_without_a_task_is_rejected_with_the_fix(pool_block: dict[str, Any]) -> None:
    provider = create_provider({"sandpool": pool_block | {"linger_s": 0}})
    with pytest.raises(errors.TaskValidationError, match="metadata.instance_id"):
        await provider.create(SandboxSpec(image="not/a-task:1"))
    await provider.aclose()
