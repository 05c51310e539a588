"""The decode hooks of Backend.generate (gridrl.engine.contract.DecodeObserver), in the torch
backend (lean and transformers forwards) and the MLX backend: every step's tokens reach the
observer and add up to the results; an interruption stops before the next step, keeps nothing,
and the same requests resubmitted sample what an uninterrupted call samples."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from engine_helpers import PROMPT

from gridrl.engine.contract import (
    DecodeInterrupted,
    DecodeObserver,
    SamplingConfig,
    SequenceRequest,
)

#: rows of different prompts, sampling configs and lengths (row 1 stops after 2 tokens, row 3
#: is greedy), so rows leave the batch at different steps.
BATCH = [
    SequenceRequest(PROMPT, SamplingConfig(max_tokens=6, temperature=1.0), seed=1),
    SequenceRequest([10, 11, 12], SamplingConfig(max_tokens=2, temperature=0.7, top_k=20), seed=2),
    SequenceRequest(PROMPT, SamplingConfig(max_tokens=5, temperature=1.0, top_p=0.9), seed=3),
    SequenceRequest([20, 21, 22, 23, 24, 25], SamplingConfig(max_tokens=4, temperature=0.0),
                    seed=4),
]


class Recorder:
    """Records each on_tokens call; ``interrupted()`` turns True once ``stop_after`` steps
    were seen (None: never). ``asked`` counts the interrupted() calls."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.steps: list[tuple[list[int], list[int], list[float]]] = []
        self.stop_after = stop_after
        self.asked = 0

    def on_tokens(self, rows: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float]) -> None:
        self.steps.append((list(rows), list(token_ids), list(logprobs)))

    def interrupted(self) -> bool:
        self.asked += 1
        return self.stop_after is not None and len(self.steps) >= self.stop_after

    def per_row(self, n: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's tokens and logprobs, concatenated over the calls."""
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        for rows, ids, lps in self.steps:
            for row, token, lp in zip(rows, ids, lps, strict=True):
                tokens[row].append(token)
                logprobs[row].append(lp)
        return tokens, logprobs


def test_observer_sees_every_step_and_they_add_up_to_the_results(backend) -> None:
    assert isinstance(Recorder(), DecodeObserver)
    recorder = Recorder()
    results = backend.generate(BATCH, None, recorder)
    tokens, logprobs = recorder.per_row(len(BATCH))
    for i, res in enumerate(results):
        assert tokens[i] == res.token_ids
        assert logprobs[i] == res.logprobs  # the very values the results hold
    # the first call is right after the prefill, with every row's first token; a row leaves
    # the calls once finished; rows ascend
    assert recorder.steps[0][0] == [0, 1, 2, 3]
    assert len(recorder.steps) == max(len(r.token_ids) for r in results)
    for step, (rows, _, _) in enumerate(recorder.steps):
        assert rows == sorted(rows)
        assert rows == [i for i, r in enumerate(results) if len(r.token_ids) > step]
    # asked between steps (and before each prefill), never after the last step
    assert recorder.asked == len(recorder.steps) - 1 + 3  # 3 distinct prompts
    assert results == backend.generate(BATCH, None)  # observing changes nothing


@pytest.mark.parametrize("k", [0, 1, 3])
def test_interruption_stops_promptly_and_a_resubmission_samples_the_same(backend, k: int
                                                                         ) -> None:
    want = backend.generate(BATCH, None)
    recorder = Recorder(stop_after=k)
    with pytest.raises(DecodeInterrupted) as info:
        backend.generate(BATCH, None, recorder)
    assert info.value.steps == k
    assert len(recorder.steps) == k  # no step after interrupted() said True
    tokens, _ = recorder.per_row(len(BATCH))
    for got, res in zip(tokens, want, strict=True):
        assert got == res.token_ids[:k]
    assert backend.generate(BATCH, None) == want
    again = Recorder()
    assert backend.generate(BATCH, None, again) == want
    assert again.per_row(len(BATCH))[0] == [r.token_ids for r in want]


def test_interruption_with_an_adapter_leaves_the_adapters_as_they_were(
        backend, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    if backend.adapter_format == "mlx":
        from gridrl.adapters import convert_files, read_dir, write_dir

        directory = tmp_path / "mlx"
        write_dir(convert_files(read_dir(tiny_adapters["a"]), "mlx", num_layers=2), directory)
    else:
        directory = tiny_adapters["a"]
    adapter = backend.load_adapter(directory, "a")
    with_adapter, base = backend.generate(BATCH, adapter), backend.generate(BATCH, None)
    assert with_adapter != base
    with pytest.raises(DecodeInterrupted):
        backend.generate(BATCH, adapter, Recorder(stop_after=2))
    assert backend.generate(BATCH, None) == base
    assert backend.generate(BATCH, adapter) == with_adapter


@pytest.mark.mlx
def test_mlx_sequence_at_a_time_path_reports_and_interrupts(tiny_llama_dir: Path,
                                                            monkeypatch) -> None:
    """Cache types mlx-lm cannot merge decode one sequence at a time: the observer hears each
    sequence's steps (one row per call) and can stop it."""
    pytest.importorskip("mlx.core")
    from gridrl.engine.backends.mlx.backend import MlxBackend

    backend = MlxBackend.from_pretrained(tiny_llama_dir, device="cpu")
    want = backend.generate(BATCH, None)
    monkeypatch.setattr(MlxBackend, "_can_merge", staticmethod(lambda cache: False))
    recorder = Recorder()
    assert backend.generate(BATCH, None, recorder) == want
    assert all(len(rows) == 1 for rows, _, _ in recorder.steps)
    assert recorder.per_row(len(BATCH))[0] == [r.token_ids for r in want]
    with pytest.raises(DecodeInterrupted):
        backend.generate(BATCH, None, Recorder(stop_after=len(want[0].token_ids) + 1))
    assert backend.generate(BATCH, None) == want
