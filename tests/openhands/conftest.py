"""Fixtures for the OpenHands integration, run with the real openhands-sdk in its own venv.

These tests need Python >= 3.12 and openhands-sdk / openhands-tools 1.58 installed;
``nox -s openhands`` builds that venv and runs them. In a venv without OpenHands this
directory is not collected (the main suite runs there), rather than reporting every test as
skipped. No test calls a real LLM: conversations are scripted with OpenHands' own ``TestLLM``.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile

import pytest

os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

if importlib.util.find_spec("openhands") is None:  # the main venv: nox -s openhands runs these
    collect_ignore_glob = ["test_*.py"]
else:
    from openhands.sdk.llm import Message, MessageToolCall, TextContent


def tool_call(name: str, **arguments: object) -> "Message":
    """An assistant message with one tool call, as an LLM would send it."""
    tool_call.n = getattr(tool_call, "n", 0) + 1  # type: ignore[attr-defined]
    return Message(role="assistant", content=[TextContent(text="")], tool_calls=[
        MessageToolCall(id=f"call_{tool_call.n}", name=name,  # type: ignore[attr-defined]
                        arguments=json.dumps(arguments), origin="completion")])


def say(text: str) -> "Message":
    """An assistant message without tool calls: OpenHands ends the turn on it."""
    return Message(role="assistant", content=[TextContent(text=text)])


@pytest.fixture(scope="session", autouse=True)
def no_terminal_left_on_the_host():
    """A tmux server started on the host during the session (OpenHands' own terminal makes one
    per executor) keeps its socket in a directory of this session: at the end none may be
    running. Any found is killed, so nothing outlives the run, and the session fails."""
    tmux_dir = tempfile.mkdtemp(prefix="oh-tmux-")  # short: a socket path fits in 107 bytes
    before = os.environ.get("TMUX_TMPDIR")
    os.environ["TMUX_TMPDIR"] = tmux_dir
    yield
    if before is None:
        del os.environ["TMUX_TMPDIR"]
    else:
        os.environ["TMUX_TMPDIR"] = before
    left = [sock for sock in glob.glob(f"{tmux_dir}/tmux-*/*")
            if subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True).returncode == 0]
    shutil.rmtree(tmux_dir, ignore_errors=True)
    assert not left, f"tmux servers (host shells) were left running on the host: {left}"


@pytest.fixture
async def pool(local_backend):
    """A reuse pool over the real bubblewrap backend (calc test image); closed after."""
    from sandpool.core.pool import SandboxPool

    async with SandboxPool(local_backend, strategy="reuse") as p:
        yield p


#: Warnings that OpenHands' own dependencies raise on import or first use (the suite turns
#: warnings into errors); each names the third-party source, none comes from sandpool.
THIRD_PARTY_WARNINGS = [
    # litellm's TypedDicts use typing.ReadOnly, which pydantic only warns about.
    "ignore:Item '.*' on TypedDict class '.*' is using the `ReadOnly` qualifier:UserWarning",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            for spec in THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))
