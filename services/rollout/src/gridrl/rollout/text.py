"""Text <-> token ids with the node's tokenizer, safe to call from many RPC threads."""

from __future__ import annotations

import threading
from collections.abc import Sequence
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

    def encode(self, text: str, chat: bool) -> list[int]:
        """Token ids of ``text``; with ``chat``, of ``text`` as one user message rendered by the
        tokenizer's chat template with the assistant turn opened (its special tokens come from
        the template, none are added).

        Raises:
            StatusError: INVALID_ARGUMENT ``apply_chat_template`` when the tokenizer has no
                chat template.
        """
        with self._lock:
            if not chat:
                return list(self.tokenizer(text)["input_ids"])
            if not self.has_chat_template:
                raise invalid_argument("apply_chat_template",
                                       "the model's tokenizer has no chat template")
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text, special tokens skipped."""
        with self._lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
