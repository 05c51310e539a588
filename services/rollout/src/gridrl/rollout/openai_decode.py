"""One sample of an OpenAI-compatible request, token by token: incremental text, stop strings,
finish reasons. Pure logic (no HTTP, no threads); :mod:`gridrl.rollout.openai_server` feeds it
the tokens the engine's decode hooks deliver.

    sample = SampleText(codec, eos_ids, stop=["\\n\\n"], stop_token_ids=(), max_tokens=64)
    delta = sample.feed(token_ids, logprobs)   # text safe to send now, tokens, finish reason

Text is detokenized incrementally the way vLLM's ``detokenize_incrementally`` does: the new
tokens are decoded together with the few before them (so a tokenizer that spells a word
differently at the start of a text, or a character split over two byte-level tokens, comes out
right), and text ending in an incomplete UTF-8 character (U+FFFD) is held back until the next
token completes it.

Stop strings (OpenAI's ``stop``): the sample ends at the first occurrence of any of them in its
text; the text returned stops before it, the token that completed it is the last token
returned (its logprob included), and the finish reason is ``"stop"``. While decoding, the last
``len(longest stop) - 1`` characters are held back, since they could begin a stop string.

Finish reasons follow :mod:`gridrl.engine.contract`: a token in ``eos_ids | stop_token_ids``
ends the sample with ``"stop"`` (it is returned; its text is empty when it is a special token);
``max_tokens`` tokens end it with ``"length"``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gridrl.engine.contract import FinishReason

_INCOMPLETE = "\ufffd"


class Detokenizer(Protocol):
    """What :class:`SampleText` needs of :class:`gridrl.rollout.text.TextCodec`."""

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass
class Delta:
    """What one :meth:`SampleText.feed` adds to a sample.

    Attributes:
        text: text safe to send now (never part of a stop string).
        token_ids: the tokens this call accepted (tokens after a stop are dropped).
        logprobs: their behaviour logprobs, natural log.
        text_offsets: for each token, the offset in the sample's text where it starts.
        finish_reason: ``"stop"`` or ``"length"`` once the sample ended, else None.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class SampleText:
    """The text, tokens and finish reason of one sample, fed one decode step at a time.

    Args:
        codec: decodes token ids to text (special tokens skipped).
        eos_ids: the backend's end-of-sequence ids.
        stop: stop strings (empty strings are ignored).
        stop_token_ids: per-request stop ids (they end the sample like eos).
        max_tokens: the request's ``max_tokens``.
    """

    def __init__(self, codec: Detokenizer, eos_ids: Collection[int], stop: Sequence[str],
                 stop_token_ids: Collection[int], max_tokens: int) -> None:
        self._codec = codec
        self._end_ids = frozenset(eos_ids) | frozenset(stop_token_ids)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text_offsets: list[int] = []  # where each token's text starts in self.text
        self.text = ""  # all the text decoded so far, stop string excluded once found
        self._sent = 0  # characters of self.text already returned by feed()
        self._prefix = 0  # vLLM's prefix_offset: decode window start
        self._read = 0  # vLLM's read_offset: tokens whose text is in self.text
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> Delta:
        """Add the sample's next tokens (one decode step, usually one token).

        Returns:
            the text that may be sent now, the tokens accepted, and the finish reason once the
            sample ended. Tokens fed after the end are ignored (an empty delta).
        """
        delta = Delta()
        for token, logprob in zip(token_ids, logprobs, strict=True):
            if self.finished:
                break
            token = int(token)
            delta.text_offsets.append(len(self.text))
            delta.token_ids.append(token)
            delta.logprobs.append(float(logprob))
            self.token_ids.append(token)
            self.logprobs.append(float(logprob))
            self.text_offsets.append(len(self.text))
            before = len(self.text)
            self.text += self._decode_new()
            if self._cut_at_stop_string(before):
                self.finish_reason = "stop"
            elif token in self._end_ids or len(self.token_ids) >= self._max_tokens:
                self.finish_reason = "stop" if token in self._end_ids else "length"
                self.text += self._flush()
        end = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        delta.text, self._sent = self.text[self._sent:end], end
        delta.finish_reason = self.finish_reason
        return delta

    def _decode_new(self) -> str:
        """vLLM's incremental step: the text the tokens from ``_read`` on add after the window
        ``[_prefix, _read)``, or "" while it ends in an incomplete character."""
        prefix_text = self._codec.decode(self.token_ids[self._prefix:self._read])
        new_text = self._codec.decode(self.token_ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE):
            self._prefix, self._read = self._read, len(self.token_ids)
            return new_text[len(prefix_text):]
        return ""

    def _flush(self) -> str:
        """At the end: whatever the last tokens decode to, incomplete characters included."""
        prefix_text = self._codec.decode(self.token_ids[self._prefix:self._read])
        new_text = self._codec.decode(self.token_ids[self._prefix:])
        self._prefix = self._read = len(self.token_ids)
        return new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""

    def _cut_at_stop_string(self, before: int) -> bool:
        """Cut ``self.text`` at the first stop string that ends after ``before``."""
        if not self._stop:
            return False
        start = max(0, before - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True
