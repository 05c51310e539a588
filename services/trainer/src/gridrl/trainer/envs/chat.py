"""Chat rendering for episodes: the prompt of the first turn, and the token ids an environment
turn appends after a model turn.

A multi-turn episode is trained as one token sequence: the prompt, then each model turn exactly
as the node sampled it (ids and behaviour logprobs), then each environment turn as the ids the
chat template adds for the appended messages. The model's text is never tokenized again (a
re-tokenization can split the same text into other ids, and the trainer would then score tokens
the model never sampled).

The delta of an environment turn (:meth:`ChatDelta.append`) is computed on ids:

1. ``closed`` = the conversation so far with the model's reply replaced by a sentinel text,
   rendered without a generation prompt, tokenized; ``opened`` = the same plus the appended
   messages (and the generation prompt of the next model turn), tokenized. ``opened`` must
   start with ``closed``: otherwise the template renders earlier turns differently once new
   messages follow (e.g. a template that drops earlier assistant turns' reasoning), and
   :class:`TemplateDeltaError` says so: training on such a conversation would not be
   token-exact.
2. What the template writes after an assistant message's content (``<|im_end|>\\n`` for
   ChatML) is taken from ``closed`` after the sentinel's ids. A reply that ended with the stop
   token already holds its first ids (the stop token): only the rest is appended. A reply cut
   by ``max_tokens`` gets the whole closing text.
3. The delta is ``closing + opened[len(closed):]``.

Sources: the "chat template delta" of prime-rl / verifiers' token-in-token-out multi-turn
rollouts, and SkyRL's and ART's handling of multi-turn token ids, all of which append the
template's tokens for new messages to the sampled ids rather than re-rendering the transcript.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gridrl.common.errors import invalid_argument

#: stands in for the model's reply when rendering (its ids are found again in the render)
SENTINEL = "GRIDRL_REPLY_SENTINEL"

Message = dict[str, Any]


class TemplateDeltaError(ValueError):
    """The chat template cannot extend a conversation token-exactly: it renders earlier turns
    differently once new messages are appended, or the assistant turn is not a plain
    continuation of the generation prompt. The message names what differs."""


def render(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool,
           tools: Sequence[Any] | None = None) -> str:
    """The chat template's text for ``messages`` (``apply_chat_template(tokenize=False)``).

    A template that rejects the system role gets the system text prepended to the first user
    message instead.

    Args:
        generation_prompt: end with the assistant turn's opening (``add_generation_prompt``).
        tools: functions or JSON schemas passed as ``tools=`` (templates that ignore them
            render as without).
    Raises:
        StatusError: INVALID_ARGUMENT on ``--model`` when the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_argument("--model", "the tokenizer has no chat template")
    msgs = [dict(m) for m in messages]
    kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
    if tools:
        kw["tools"] = list(tools)
    try:
        return tokenizer.apply_chat_template(msgs, **kw)
    except Exception:  # jinja raise_exception, e.g. "System role not supported"
        if not msgs or msgs[0]["role"] != "system" or len(msgs) < 2:
            raise
        system = msgs.pop(0)["content"]
        msgs[0] = {**msgs[0], "content": f"{system}\n\n{msgs[0]['content']}"}
        return tokenizer.apply_chat_template(msgs, **kw)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered template text (its own special tokens kept, none added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: Sequence[Message],
               tools: Sequence[Any] | None = None) -> list[int]:
    """The first model turn's prompt: ``messages`` rendered with the tokenizer's chat template
    plus the generation prompt (:func:`render`), as token ids (the template's own special
    tokens kept, none added).

    Raises:
        StatusError: INVALID_ARGUMENT on ``--model`` when the tokenizer has no chat template.
    """
    return encode(tokenizer, render(tokenizer, messages, generation_prompt=True, tools=tools))


def tool_schema(func: Any) -> dict[str, Any]:
    """The JSON schema the chat template shows for the function ``func`` (transformers'
    ``get_json_schema``: type hints and a Google-style docstring with an ``Args:`` section).

    Raises:
        ValueError: ``func`` lacks a docstring, a type hint or an argument's description.
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ValueError(f"tool {getattr(func, '__name__', func)!r}: {e}") from e


@dataclass
class ChatDelta:
    """Token ids of environment turns for one tokenizer (and tool list).

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        tools: what the episode's prompt was rendered with (``tools=``), or None.
    """

    tokenizer: Any
    tools: Sequence[Any] | None = None

    def append(self, history: Sequence[Message], reply_ids: Sequence[int], stopped: bool,
               new: Sequence[Message], *, generation_prompt: bool = True) -> list[int]:
        """The ids that follow a model reply when the environment appends ``new``.

        Args:
            history: the conversation before the reply (what the reply's prompt rendered).
            reply_ids: the ids the model sampled for the reply (never re-tokenized; only its
                last id is read, to see whether it is the template's closing token).
            stopped: the reply ended with a stop token (False: cut by ``max_tokens``).
            new: the messages the environment appends (``user`` or ``tool`` roles).
            generation_prompt: end with the next assistant turn's opening (False: the
                episode ends here and the delta only closes the turn).
        Returns:
            the delta's ids (closing of the assistant turn, the new messages, and the next
            generation prompt).
        Raises:
            TemplateDeltaError: the template rewrites earlier turns when ``new`` is appended,
                or the assistant turn does not continue the generation prompt.
        """
        tok = self.tokenizer
        before = encode(tok, render(tok, history, generation_prompt=True, tools=self.tools))
        with_reply = [*history, {"role": "assistant", "content": SENTINEL}]
        closed = encode(tok, render(tok, with_reply, generation_prompt=False, tools=self.tools))
        if closed[:len(before)] != before:
            raise TemplateDeltaError(
                "the chat template's assistant turn does not continue its generation prompt "
                f"(first difference at token {_first_difference(before, closed)})")
        sentinel = encode(tok, SENTINEL)
        at = _find(closed, sentinel, len(before))
        if at < 0:
            raise TemplateDeltaError("the chat template alters the assistant message's content")
        closing = closed[at + len(sentinel):]
        if stopped and reply_ids and closing and closing[0] == reply_ids[-1]:
            closing = closing[1:]
        opened = encode(tok, render(tok, [*with_reply, *new], generation_prompt=generation_prompt,
                                    tools=self.tools))
        if opened[:len(closed)] != closed:
            raise TemplateDeltaError(
                "the chat template renders earlier turns differently once messages are "
                f"appended (first difference at token {_first_difference(closed, opened)} of "
                f"{len(closed)}); a token-exact episode cannot be built with it")
        return closing + opened[len(closed):]


def _find(ids: Sequence[int], part: Sequence[int], start: int) -> int:
    """Index of the first occurrence of ``part`` in ``ids`` at or after ``start``; -1 if none."""
    n = len(part)
    for i in range(start, len(ids) - n + 1):
        if list(ids[i:i + n]) == list(part):
            return i
    return -1


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
