"""Tool-calling environments: Python functions offered to the model, its calls parsed from its
reply in the model family's format, their results appended as ``tool`` messages.

- **Offering.** The functions go to the chat template as ``apply_chat_template(tools=[...])``
  (transformers builds each JSON schema from the type hints and the Google-style docstring,
  ``transformers.utils.get_json_schema``). A template that ignores ``tools=`` (SmolLM2-Instruct's
  renders the messages only) gets the schemas in its system message instead, in the format
  SmolLM2-Instruct was tuned on for function calling (its model card: the schemas inside
  ``<tools></tools>``, calls as ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>``).
- **Parsing** (:func:`parse_tool_calls`), by format (:func:`tool_format` reads the template):
  ``"hermes"`` -- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5,
  Qwen3, Hermes, SmolLM3), a JSON list inside a block accepted (SmolLM2); ``"llama3"`` -- a
  JSON object ``{"name": ..., "parameters": {...}}`` as the whole reply, optionally after
  ``<|python_tag|>``, several separated by ``;`` (Llama 3.1-3.3's JSON tool calling).
- **Calling.** Each call runs in its own daemon thread, waited on for ``timeout_s``; a call that
  does not return by then is reported as timed out to the model and left to finish on its own
  (Python cannot stop a thread). A malformed call (not JSON, no name, unknown function,
  arguments that do not bind to the signature) or a raising function becomes an error message in
  the tool turn, so the model can try again; nothing raises out of the environment. Calls,
  errors and timeouts are counted (``tool_calls``, ``tool_errors``, ``tool_timeouts``).
- **Ending.** A reply with no tool call is the final answer: the episode is done.
"""

from __future__ import annotations

import inspect
import json
import random
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gridrl.trainer.envs.base import EVAL_SEED, Environment, EnvTurn, Message, TaskItem
from gridrl.trainer.envs.chat import render, tool_schema

#: the counters a tool environment reports per episode
TOOL_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts")

HERMES = "hermes"
LLAMA3 = "llama3"

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


def tool_format(tokenizer: Any) -> str:
    """The tool-call format of the tokenizer's chat template: :data:`LLAMA3` when the template
    speaks of ``<|python_tag|>`` or the ``ipython`` role, else :data:`HERMES` (also for
    templates without tool support, which get SmolLM2's ``<tool_call>`` format)."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return HERMES


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows ``tools=`` (rendering with a tool differs from without)."""
    def probe(x: int) -> int:
        """A probe.

        Args:
            x: a number.
        """
        return x

    msgs = [{"role": "user", "content": "hi"}]
    return (render(tokenizer, msgs, generation_prompt=True, tools=[tool_schema(probe)])
            != render(tokenizer, msgs, generation_prompt=True))


def system_prompt_with_tools(system: str, schemas: Sequence[dict[str, Any]]) -> str:
    """``system`` followed by the tools in SmolLM2-Instruct's function-calling format, for
    templates that do not render ``tools=`` themselves."""
    listing = "\n".join(json.dumps(s.get("function", s)) for s in schemas)
    return (f"{system}\n\nYou have access to the following tools:\n<tools>{listing}</tools>\n"
            "To call tools, reply with <tool_call>[{\"name\": \"func_name\", \"arguments\": "
            "{\"argument\": \"value\"}}]</tool_call> and nothing else; the results come back "
            "in a tool message. When you have the answer, reply with it without a tool call.")


def parse_tool_calls(text: str, fmt: str = HERMES) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in a model reply.

    Args:
        text: the reply, decoded with special tokens kept where the format needs them
            (``<|python_tag|>``; ``<tool_call>`` is plain text in most vocabularies).
        fmt: :data:`HERMES` or :data:`LLAMA3`.
    Returns:
        ``(calls, errors)``: the well-formed calls in order, and one message per malformed
        one (bad JSON, no ``name``, arguments not an object). Both empty: no tool call (the
        reply is a final answer).
    """
    if fmt == LLAMA3:
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text.strip()
        if not body.startswith("{"):
            return [], []
        raw = [part for part in body.split(";") if part.strip()]
        keys = ("parameters", "arguments")
    else:
        raw = [m.group(1) for m in _BLOCK.finditer(text)]
        keys = ("arguments", "parameters")
    calls: list[ToolCall] = []
    errors: list[str] = []
    for chunk in raw:
        try:
            value = json.loads(chunk.strip())
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos}): "
                          f"{chunk.strip()[:80]!r}")
            continue
        for obj in value if isinstance(value, list) else [value]:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                errors.append(f"a tool call needs a \"name\": {json.dumps(obj)[:80]}")
                continue
            args = next((obj[k] for k in keys if k in obj), {})
            if isinstance(args, str):  # some models send the arguments JSON-encoded
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            if not isinstance(args, dict):
                errors.append(f"the arguments of {obj['name']} must be an object")
                continue
            calls.append(ToolCall(obj["name"], args))
    return calls, errors


def call_with_timeout(func: Callable[..., Any], arguments: dict[str, Any],
                      timeout_s: float) -> tuple[str, Any]:
    """Run ``func(**arguments)`` in a daemon thread for at most ``timeout_s`` seconds.

    Returns:
        ``("ok", result)``, ``("error", message)`` (it raised) or ``("timeout", None)``.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = func(**arguments)
        except Exception as e:
            box["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=run, name=f"tool-{getattr(func, '__name__', 'call')}",
                              daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "timeout", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("result")


class ToolEnv(Environment):
    """An environment whose model may call Python functions before answering.

    Subclasses give :meth:`tools`, the items and :meth:`score`; this class offers the tools,
    parses the calls and runs them.

    Args:
        tokenizer: the run's tokenizer (its template decides the format and whether the tools
            go in the system message).
        timeout_s: seconds each call may take.
        max_calls: calls run per model turn (more get an error message).
    """

    max_turns: ClassVar[int] = 4

    def __init__(self, tokenizer: Any = None, *, timeout_s: float = 5.0,
                 max_calls: int = 4) -> None:
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self.format = HERMES
        self.tools_in_system = True
        if tokenizer is not None:
            self.prepare(tokenizer)

    def prepare(self, tokenizer: Any) -> None:
        """Adopt ``tokenizer``'s tool format, and whether its template renders ``tools=``."""
        self.format = tool_format(tokenizer)
        self.tools_in_system = not template_renders_tools(tokenizer)

    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schema of each tool."""
        return [tool_schema(f) for f in self.tools()]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as ``tools=`` (None when they are in the system
        message)."""
        return None if self.tools_in_system else self.schemas()

    def messages(self, system: str, user: str) -> tuple[dict[str, str], ...]:
        """An item's messages: ``system`` (with the tools listed when the template does not
        render them) and the ``user`` request."""
        if self.tools_in_system:
            system = system_prompt_with_tools(system, self.schemas())
        return ({"role": "system", "content": system}, {"role": "user", "content": user})

    def respond(self, item: TaskItem, transcript: list[Message],
                state: dict[str, Any]) -> EnvTurn:
        """Run the calls of the last reply and append one ``tool`` message per call (or per
        malformed call); a reply without a call ends the episode."""
        calls, errors = parse_tool_calls(transcript[-1]["content"], self.format)
        if not calls and not errors:  # counted as zeros, so the step's figures always show them
            return EnvTurn(done=True, counts=dict.fromkeys(TOOL_COUNTS, 0))
        counts = {"tool_calls": len(calls) + len(errors), "tool_errors": len(errors),
                  "tool_timeouts": 0}
        out: list[Message] = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
        table = {f.__name__: f for f in self.tools()}
        for i, call in enumerate(calls):
            status, value = self._run(call, table, i)
            if status == "ok":
                text = value if isinstance(value, str) else json.dumps(value, default=str)
            else:
                counts["tool_timeouts" if status == "timeout" else "tool_errors"] += 1
                text = (f"Error: {call.name} did not answer within {self.timeout_s:g} s"
                        if status == "timeout" else f"Error: {value}")
            out.append({"role": "tool", "name": call.name, "content": text})
        return EnvTurn(out, counts=counts)

    def _run(self, call: ToolCall, table: dict[str, Callable[..., Any]],
             index: int) -> tuple[str, Any]:
        if index >= self.max_calls:
            return "error", f"at most {self.max_calls} tool calls per turn"
        func = table.get(call.name)
        if func is None:
            return "error", f"no tool named {call.name!r} (tools: {', '.join(table)})"
        try:
            inspect.signature(func).bind(**call.arguments)
        except TypeError as e:
            return "error", f"{call.name}: {e}"
        return call_with_timeout(func, call.arguments, self.timeout_s)


# --------------------------------------------------------------------------- the demo

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a * b


TOOL_SYSTEM_PROMPT = "You answer arithmetic questions. Use the tools to compute."


class ToolArithmetic(ToolEnv):
    """``tool-arithmetic``: a product or sum of two 2-3 digit numbers, with ``add`` and
    ``multiply`` tools; the score is 1 when the final reply contains the exact result.

    Args:
        seed: the training stream's seed (the held-out set uses :data:`EVAL_SEED`).
        eval_size: held-out questions.
        tokenizer, timeout_s, max_calls: as :class:`ToolEnv`.
    """

    name = "tool-arithmetic"
    max_tokens: ClassVar[int] = 48
    eval_tasks: ClassVar[int] = 32

    def __init__(self, tokenizer: Any = None, *, seed: int = 0, eval_size: int = 32,
                 timeout_s: float = 5.0, max_calls: int = 4) -> None:
        super().__init__(tokenizer, timeout_s=timeout_s, max_calls=max_calls)
        self.seed = seed
        self.eval_size = eval_size
        self._eval = [self._question(f"eval:{EVAL_SEED}:{j}") for j in range(eval_size)]
        self._held = set(self._eval)

    def tools(self) -> list[Callable[..., Any]]:
        return [add, multiply]

    @staticmethod
    def _question(key: str) -> tuple[str, int, int]:
        r = random.Random(key)
        return r.choice("+*"), r.randint(10, 999), r.randint(10, 99)

    def _item(self, q: tuple[str, int, int]) -> TaskItem:
        op, a, b = q
        text = f"What is {a} {'plus' if op == '+' else 'times'} {b}?"
        answer = a + b if op == "+" else a * b
        return TaskItem(prompt=text, messages=self.messages(TOOL_SYSTEM_PROMPT, text),
                        columns={"answer": str(answer)})

    def train_item(self, index: int) -> TaskItem:
        attempt = 0
        while True:
            q = self._question(f"train:{self.seed}:{index}:{attempt}")
            if q not in self._held:
                return self._item(q)
            attempt += 1

    def eval_items(self) -> list[TaskItem]:
        return [self._item(q) for q in self._eval]

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """1.0 when the final reply holds the exact result as a number, else 0.0."""
        return [float(a in re.findall(r"-?\d+", c.replace(",", "")))
                for c, a in zip(completions, columns["answer"], strict=True)]
