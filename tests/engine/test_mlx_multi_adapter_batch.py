"""Batches whose rows decode with different mlx-lm adapters on the MLX backend (issue 46 item
1): ``MlxBackend.generate_mixed`` decodes every row in one batch, one base product per linear
plus one small product per adapter group (``LoRAManager.activate_rows``), and each row's tokens
and processed logprobs are those it gets in a one-adapter batch, at float32 rounding. Rows stop
singly between two decode steps (``rows_to_stop``) and follow the batch's rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import write_mlx_adapter
from float_bounds import ROUNDING_REL, assert_close_to_largest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from gridrl.engine.contract import SamplingConfig, SequenceRequest  # noqa: E402

pytestmark = pytest.mark.mlx

PROMPTS = [[5, 11, 12, 6], [5, 30, 31, 32, 33, 6], [5, 11, 12, 6], [7, 8, 9], [5, 40, 6],
           [5, 11, 12, 6], [9, 21, 22, 23, 24, 25, 6]]
#: the adapter of each row: "a" (q/v of the last block, r 4), "b" (o/up/down of every block,
#: r 8), None (the base model).
ROW_ADAPTERS = ["a", None, "b", "a", "b", "b", None]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-mixed")
    return {"a": write_mlx_adapter(root / "a", tiny_llama_dir, rank=4, scale=2.0, num_layers=1,
                                   keys=["self_attn.q_proj", "self_attn.v_proj"], seed=1),
            "b": write_mlx_adapter(root / "b", tiny_llama_dir, rank=8, scale=1.5,
                                   num_layers=-1, seed=2,
                                   keys=["self_attn.o_proj", "mlp.down_proj", "mlp.up_proj"])}


@pytest.fixture(scope="module")
def backend(tiny_llama_dir: Path):
    from gridrl.engine.backends.mlx.backend import MlxBackend

    return MlxBackend.from_pretrained(tiny_llama_dir)


def _rows(sampling: SamplingConfig) -> list[SequenceRequest]:
    # different max_tokens, so rows leave the batch at different steps
    return [SequenceRequest(p, SamplingConfig(**{**sampling.__dict__,
                                                 "max_tokens": sampling.max_tokens - i % 3}),
                            seed=100 + i) for i, p in enumerate(PROMPTS)]


class Recorder:
    """An observer that records each batch row's tokens and stops ``stop`` rows at ``at``."""

    def __init__(self, stop: tuple[int, ...] = (), at: int = 0) -> None:
        self.seen: dict[int, list[int]] = {}
        self.steps = 0
        self.stop, self.at = stop, at
        self.rows_per_step: list[int] = []

    def on_tokens(self, rows, tokens, logprobs, top=None):
        self.steps += 1
        self.rows_per_step.append(len(rows))
        for r, t in zip(rows, tokens, strict=True):
            self.seen.setdefault(r, []).append(t)

    def interrupted(self):
        return False

    def rows_to_stop(self):
        return list(self.stop) if self.steps == self.at else []


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_tokens=9, temperature=0.0),
    SamplingConfig(max_tokens=9, temperature=0.9, top_k=30, top_logprobs=3)],
    ids=["greedy", "T0.9-top-k"])
def test_each_row_of_a_mixed_batch_decodes_as_in_a_one_adapter_batch(
        backend, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        sampling: SamplingConfig) -> None:
    from gridrl.engine.backends.mlx.lora import LoRAManager

    handles = {name: backend.load_adapter(d, f"mixed-{name}") for name, d in adapter_dirs.items()}
    try:
        adapters = [None if a is None else handles[a] for a in ROW_ADAPTERS]
        rows = _rows(sampling)
        calls: list[int] = []
        real = LoRAManager.activate_rows

        def spy(self, per_row):
            calls.append(len(per_row))
            return real(self, per_row)

        monkeypatch.setattr(LoRAManager, "activate_rows", spy)
        observer = Recorder()
        got = backend.generate_mixed(rows, adapters, observer)
        assert backend.batches_exactly and backend.mixes_adapters
        assert calls == [len(rows)]  # one batch, every row
        assert observer.rows_per_step[0] == len(rows)
        # the reference: each adapter's rows in a batch of their own
        want: dict[int, object] = {}
        for name in ("a", "b", None):
            idx = [i for i, a in enumerate(ROW_ADAPTERS) if a == name]
            alone = backend.generate([rows[i] for i in idx],
                                     None if name is None else handles[name])
            want.update(zip(idx, alone, strict=True))
        for i, result in enumerate(got):
            ref = want[i]
            assert result.token_ids == ref.token_ids, f"row {i} ({ROW_ADAPTERS[i]})"
            assert result.finish_reason == ref.finish_reason
            assert_close_to_largest(result.logprobs, ref.logprobs, ROUNDING_REL,
                                    f"row {i} behaviour logprobs")
            if sampling.top_logprobs:
                assert [[t for t, _ in s] for s in result.top_logprobs] == \
                    [[t for t, _ in s] for s in ref.top_logprobs]
                assert_close_to_largest([[lp for _, lp in s] for s in result.top_logprobs],
                                        [[lp for _, lp in s] for s in ref.top_logprobs],
                                        ROUNDING_REL, f"row {i} processed logprobs")
            assert observer.seen[i] == result.token_ids  # the batch's own row indices
        # the adapters matter: the same prompt under a, b and the base model differs
        assert got[0].logprobs != got[2].logprobs
        assert backend.generate([rows[0]], None)[0].logprobs != got[0].logprobs
        # and nothing stays set: the base model again decodes as the base model
        again = backend.generate([rows[1]], None)[0]
        assert again.token_ids == got[1].token_ids
    finally:
        for handle in handles.values():
            backend.unload_adapter(handle)


def test_rows_stop_singly_and_an_adapter_loads_mid_batch(backend, adapter_dirs, tmp_path,
                                                         tiny_llama_dir) -> None:
    """Rows named by ``rows_to_stop`` end there; the others go on as if alone, also when an
    adapter is loaded (and a row's adapter unloaded) between two decode steps, which is what
    a push of one run does while another run's rows decode (``Backend.stops_rows``)."""
    assert backend.stops_rows
    handles = {name: backend.load_adapter(d, f"stop-{name}") for name, d in adapter_dirs.items()}
    sampling = SamplingConfig(max_tokens=8, temperature=1.0)
    rows = [SequenceRequest(p, sampling, seed=7 + i) for i, p in enumerate(PROMPTS[:4])]
    adapters = [handles["a"], handles["b"], None, handles["a"]]
    late = write_mlx_adapter(tmp_path / "late", tiny_llama_dir, rank=2, scale=1.0,
                             num_layers=-1, keys=["mlp.gate_proj", "self_attn.k_proj"], seed=9)
    loaded = []

    class LoadsMidBatch(Recorder):
        def rows_to_stop(self):
            if self.steps == 3 and not loaded:  # a push between two steps
                loaded.append(backend.load_adapter(late, "stop-late"))
                backend.unload_adapter(handles["a"])  # rows 0, 3: cut here, so safe
            return super().rows_to_stop()

    observer = LoadsMidBatch(stop=(0, 3), at=3)
    try:
        got = backend.generate_mixed(rows, adapters, observer)
        assert [len(got[i].token_ids) for i in (0, 3)] == [3, 3]
        for i in (1, 2):
            alone = backend.generate([rows[i]], adapters[i])[0]
            assert got[i].token_ids == alone.token_ids
            assert_close_to_largest(got[i].logprobs, alone.logprobs, ROUNDING_REL, f"row {i}")
        assert observer.rows_per_step[3:] and max(observer.rows_per_step[3:]) <= 2
    finally:
        for handle in [handles["b"], *loaded]:
            backend.unload_adapter(handle)


def test_mixed_batch_refuses_misaligned_or_unloaded_adapters(backend, adapter_dirs) -> None:
    handle = backend.load_adapter(adapter_dirs["a"], "gone")
    backend.unload_adapter(handle)
    rows = _rows(SamplingConfig(max_tokens=3))[:2]
    with pytest.raises(ValueError, match="1 adapters for 2 sequences"):
        backend.generate_mixed(rows, [None])
    with pytest.raises(ValueError, match="unloaded"):
        backend.generate_mixed(rows, [handle, None])
