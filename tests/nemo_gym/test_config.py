"""The server config, read by NeMo Gym's own config parser: errors name the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from pydantic import ValidationError

from nemo_gym.global_config import GlobalConfigDictParser, get_first_server_config_dict
from sandpool.core import errors
from sandpool.integrations.nemo_gym import CONFIG_PATH
from sandpool.integrations.nemo_gym.config import PoolSettings
from sandpool.integrations.nemo_gym.server import SandpoolSweConfig
from tests.nemo_gym.conftest import MAIN


def _load(tmp_path: Path, **inner: Any) -> SandpoolSweConfig:
    """Parse the shipped YAML plus ``inner`` overrides and validate it as NeMo Gym does."""
    overrides = tmp_path / "o.yaml"
    overrides.write_text(json.dumps({MAIN: {"resources_servers": {"sandpool_swe": inner}}}))
    gcd = GlobalConfigDictParser().parse_no_environment(
        OmegaConf.create({"config_paths": [str(CONFIG_PATH), str(overrides)]}))
    cfg = get_first_server_config_dict(gcd, MAIN)
    return SandpoolSweConfig.model_validate(OmegaConf.to_container(cfg, resolve=True) | {"name": MAIN})


def test_shipped_config_validates(tmp_path: Path) -> None:
    cfg = _load(tmp_path)
    assert cfg.entrypoint == "app.py" and cfg.num_workers == 1
    assert cfg.sandpool == PoolSettings(backend="local", strategy="reuse", tasks="default", concurrency=8,
                                        idle_timeout_s=600, exec_timeout_s=60, max_exec_timeout_s=600,
                                        grade_timeout_s=300, max_output_bytes=65536,
                                        num_repeats=1)


@pytest.mark.parametrize(("inner", "key"), [
    ({"sandpool": {"strategy": "fast"}}, "sandpool.strategy"),
    ({"sandpool": {"backend": "docker"}}, "sandpool.backend"),
    ({"sandpool": {"concurrency": 0}}, "sandpool.concurrency"),
    ({"sandpool": {"num_repeats": 0}}, "sandpool.num_repeats"),
    ({"sandpool": {"idle_timeout_s": -1}}, "sandpool.idle_timeout_s"),
    ({"sandpool": {"stratgy": "reuse"}}, "sandpool.stratgy"),
    ({"sandpool": {"exec_timeout_s": 900}}, "max_exec_timeout_s"),
    ({"num_workers": 4}, "num_workers"),
])
def test_bad_config_names_the_key(tmp_path: Path, inner: dict[str, Any], key: str) -> None:
    with pytest.raises(ValidationError) as info:
        _load(tmp_path, **inner)
    assert key in str(info.value)


async def test_missing_task_file_names_the_key() -> None:
    with pytest.raises(errors.ConfigError, match=r"sandpool\.tasks: no such file"):
        await PoolSettings(tasks="/nonexistent/tasks.jsonl").load_tasks()

