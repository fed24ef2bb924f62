"""A scripted LLM for OpenHands agent-servers under test, loaded into the server process.

Importing it registers the litellm provider ``sandpool_scripted``: an OpenHands ``LLM`` with
``model="sandpool_scripted/<anything>"`` and ``litellm_extra_body={"sandpool_script": [...]}``
answers from the script instead of calling a model. The script travels with the agent the
client sends (``litellm_extra_body`` is part of the serialized ``LLM``), and the step to play is
the number of assistant messages already in the conversation, so the provider keeps no state.

A step is ``{"tool": name, "arguments": {...}}`` (one tool call), ``{"text": "..."}`` (a
message without tool calls, which ends the agent's turn), or ``{"probe": "find_spec", "name": module}``
(a message, ending the turn, saying where the server process would import ``module`` from,
or ``null``: whether code a policy planted would run in the server). A completion offered no tools (the
agent-server's conversation-title request) gets a fixed title and does not consume a step.
"""

from __future__ import annotations

import importlib.util
import json
import time

import litellm
from litellm import CustomLLM
from litellm.types.utils import ChatCompletionMessageToolCall, Choices, Function, Message, ModelResponse

PROVIDER = "sandpool_scripted"


class ScriptedLLM(CustomLLM):
    """Plays ``sandpool_script`` from the request's extra body, one step per completion."""

    def completion(self, model, messages, *args, optional_params=None, **kwargs):  # type: ignore[no-untyped-def]
        params = dict(optional_params or {})
        body = params.get("extra_body") or {}
        script = body.get("sandpool_script") or params.get("sandpool_script")
        if script is None:
            raise ValueError("sandpool_scripted: no sandpool_script in litellm_extra_body")
        if not params.get("tools"):
            return _response(model, Message(role="assistant", content="Scripted conversation"))
        step_no = sum(1 for m in messages if _role(m) == "assistant")
        if step_no >= len(script):
            raise ValueError(f"sandpool_scripted: script of {len(script)} steps is exhausted")
        step = script[step_no]
        if step.get("probe") == "find_spec":
            spec = importlib.util.find_spec(step["name"])
            return _response(model, Message(role="assistant", content=json.dumps(spec and spec.origin)))
        if "text" in step:
            return _response(model, Message(role="assistant", content=step["text"]))
        call = ChatCompletionMessageToolCall(id=f"call_{step_no}", type="function",
                                             function=Function(name=step["tool"],
                                                               arguments=json.dumps(step["arguments"])))
        return _response(model, Message(role="assistant", content="", tool_calls=[call]))

    async def acompletion(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.completion(*args, **kwargs)


def _role(message) -> str:  # type: ignore[no-untyped-def]
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", "")


def _response(model: str, message: Message) -> ModelResponse:
    return ModelResponse(id=f"scripted-{time.monotonic_ns()}", model=model, created=int(time.time()),
                         choices=[Choices(index=0, finish_reason="stop", message=message)])


litellm.custom_provider_map = [*[p for p in litellm.custom_provider_map if p["provider"] != PROVIDER],
                               {"provider": PROVIDER, "custom_handler": ScriptedLLM()}]
