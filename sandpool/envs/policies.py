"""Policies that act in a sandbox for one episode: ``oracle``, ``noop`` and an OpenAI-compatible chat.

A policy only acts; the runner grades afterwards. A policy raises
:class:`~sandpool.core.errors.TaskError` for its own failure (the rollout ends ``task_failed``);
sandbox errors propagate as :class:`~sandpool.core.errors.InfraError` (``infra_failed``).
"""

from __future__ import annotations

import abc
import difflib
import re

import httpx

from sandpool.core import errors
from sandpool.core.pool import Lease
from sandpool.core.task import Task

__all__ = ["ChatPolicy", "NoopPolicy", "OraclePolicy", "Policy", "get_policy"]


class Policy(abc.ABC):
    """Acts in a leased sandbox for one episode of ``task``."""

    name: str = "policy"

    @abc.abstractmethod
    async def act(self, lease: Lease, task: Task) -> None:
        """Run the episode's actions. Raises ``TaskError`` for the policy's own failure."""

    async def aclose(self) -> None:
        """Release clients the policy holds."""


class NoopPolicy(Policy):
    """Looks at the repo and changes nothing (reward 0 on a valid task)."""

    name = "noop"

    async def act(self, lease: Lease, task: Task) -> None:
        await lease.exec("git status --short", timeout=30)


class OraclePolicy(Policy):
    """Applies the task's gold ``patch`` with ``git apply`` (reward 1 on a valid task)."""

    name = "oracle"

    async def act(self, lease: Lease, task: Task) -> None:
        await lease.exec("git status --short", timeout=30)
        await lease.write_file("/tmp/gold.patch", task.patch.encode())
        res = await lease.exec("git apply --whitespace=nowarn /tmp/gold.patch", timeout=60)
        if not res.ok:
            raise errors.TaskError(f"gold patch did not apply: {res.err_text.strip()[:300]}")


_SYSTEM = """You are fixing a bug in the repository at {workdir}. Each reply must contain exactly
one shell command in a ```bash fenced block; you will see its exit code and output. When the
fix is complete, reply with the single word SUBMIT. The machine has no network."""

_BLOCK = re.compile(r"```(?:bash|sh)?\s*\n(.*?)```", re.S)


class ChatPolicy(Policy):
    """Talks to any OpenAI-compatible ``/v1/chat/completions`` endpoint over httpx.

    Each turn the model sends one ```bash``` block; its output (capped) goes back as the next
    user message, until the model says ``SUBMIT`` or ``max_steps`` is reached.

    Args:
        base_url: Endpoint root, e.g. ``http://127.0.0.1:8000/v1``.
        model: Model name sent in the request.
        api_key: Bearer token, if the endpoint needs one.
        max_steps: Commands per episode.
        command_timeout: Seconds per command (server-side in the sandbox).
        request_timeout: Seconds per HTTP request to the endpoint.
    """

    name = "chat"

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, max_steps: int = 20,
                 command_timeout: float = 120.0, request_timeout: float = 300.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                         timeout=request_timeout)
        self.model = model
        self.max_steps = max_steps
        self.command_timeout = command_timeout

    async def _complete(self, messages: list[dict[str, str]]) -> str:
        try:
            resp = await self._client.post("/chat/completions", json={"model": self.model, "messages": messages})
            resp.raise_for_status()
            return str(resp.json()["choices"][0]["message"]["content"] or "")
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            # The policy's own endpoint failing is the policy's failure, not the sandbox's.
            raise errors.TaskError(f"chat endpoint failed: {type(exc).__name__}: {exc}") from exc

    async def act(self, lease: Lease, task: Task) -> None:
        messages = [
            {"role": "system", "content": _SYSTEM.format(workdir=lease.workdir)},
            {"role": "user", "content": task.problem_statement},
        ]
        for _ in range(self.max_steps):
            reply = await self._complete(messages)
            messages.append({"role": "assistant", "content": reply})
            block = _BLOCK.search(reply)
            if block is None:
                if "SUBMIT" in reply:
                    return
                messages.append({"role": "user", "content": "Reply with one ```bash block, or SUBMIT."})
                continue
            res = await lease.exec(block.group(1), timeout=self.command_timeout, max_output=16_384)
            note = " (timed out)" if res.timed_out else ""
            messages.append({"role": "user", "content": f"exit code {res.exit_code}{note}\n"
                             f"{res.text[-8000:]}{res.err_text[-4000:]}"})

    async def aclose(self) -> None:
        await self._client.aclose()


def get_policy(name: str, **chat_options: object) -> Policy:
    """Return a policy by name: ``oracle``, ``noop`` or ``chat`` (which takes ``base_url``,
    ``model`` and the other :class:`ChatPolicy` options).

    Raises:
        ConfigError: Unknown name, or ``chat`` without ``base_url``/``model``.
    """
    if name == "oracle":
        return OraclePolicy()
    if name == "noop":
        return NoopPolicy()
    if name == "chat":
        if not chat_options.get("base_url") or not chat_options.get("model"):
            raise errors.ConfigError("policy 'chat' needs --chat-url and --model (an OpenAI-compatible endpoint)")
        return ChatPolicy(**chat_options)  # type: ignore[arg-type]
    near = difflib.get_close_matches(name, ["oracle", "noop", "chat"], n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise errors.ConfigError(f"--policy {name!r} is not known: use oracle, noop or chat{hint}")
