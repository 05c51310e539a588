"""Stop strings on samples from an engine that stops on token ids only.

The rollout nodes stop on eos and stop token ids. A stop *string* (Tinker's
``SamplingParams.stop`` as strings) is applied after sampling: a sample is cut after the first
token whose text completes one of them, and reported as stopped. The tokens kept and their
logprobs are exactly as sampled (sampling is causal: what came after the cut never influenced
them), so behaviour logprobs stay exact; the cost is the tokens decoded past the cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def cut_at_stop(token_ids: Sequence[int], stop_strings: Sequence[str],
                decode: Callable[[list[int]], str]) -> int | None:
    """How many tokens to keep: the length of the shortest prefix whose text contains a stop
    string, or None when the text of all of them contains none.

    Args:
        token_ids: the sample's tokens.
        stop_strings: non-empty strings.
        decode: token ids -> text (special tokens kept, so a stop string that is a special
            token's text matches).
    """
    if not stop_strings or not token_ids:
        return None
    if not any(s in decode(list(token_ids)) for s in stop_strings):
        return None
    lo, hi = 1, len(token_ids)  # text of a prefix only grows: bisect the first that matches
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(list(token_ids[:mid])) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo
