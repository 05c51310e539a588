"""Text <-> token ids with the node's tokenizer, safe to call from many RPC threads."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gridrl.common.errors import invalid_argument


class TextCodec:
    """Encodes prompts and decodes samples with a ``transformers`` tokenizer.

    Fast tokenizers are not safe to share between threads (concurrent calls can fail with
    "Already borrowed"), so every call takes one lock; each is sub-millisecond.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, chat: bool, system: str = "") -> list[int]:
        """Token ids of ``text``; with ``chat``, of ``text`` as one user message (after a
        ``system`` message when given) rendered by the tokenizer's chat template with the
        assistant turn opened (its special tokens come from the template, none are added).

        Raises:
            StatusError: INVALID_ARGUMENT ``apply_chat_template`` when the tokenizer has no
                chat template.
        """
        if chat:
            system_turn = [{"role": "system", "content": system}] if system else []
            return self.encode_chat([*system_turn, {"role": "user", "content": text}],
                                    "system_prompt" if system else "apply_chat_template")
        with self._lock:
            return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], field: str) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}`` dicts) rendered by the tokenizer's
        chat template with the assistant turn opened (its special tokens come from the
        template, none are added).

        Raises:
            StatusError: INVALID_ARGUMENT ``field`` when the tokenizer has no chat template or
                the template refuses the messages (e.g. roles out of order).
        """
        if not self.has_chat_template:
            raise invalid_argument(field, "the model's tokenizer has no chat template")
        with self._lock:
            try:
                rendered = self.tokenizer.apply_chat_template(
                    [dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja2's TemplateError, or what the template raises
                raise invalid_argument(field, f"the model's chat template refused them: "
                                              f"{e}") from e
            return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text, special tokens skipped."""
        with self._lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token on its own as text, special tokens included (e.g. ``"</s>"``); a token
        holding part of a UTF-8 character decodes to U+FFFD."""
        with self._lock:
            return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
