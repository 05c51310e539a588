"""The pure pieces of the training primitives: request order, futures, stop strings, paths and
the checks of datums and settings. No model, no RPC, no sleeps."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from gridrl.common.errors import Kind, StatusError
from gridrl.trainer.primitives import paths
from gridrl.trainer.primitives.futures import Done, Failed, FutureStore, Pending
from gridrl.trainer.primitives.ordering import SequenceGate
from gridrl.trainer.primitives.stops import cut_at_stop
from gridrl.trainer.primitives.types import (
    AdamSettings,
    Datum,
    LoraRequest,
    LossSpec,
    SamplingSpec,
    check_datums,
)


def field_of(error: pytest.ExceptionInfo) -> str:
    assert isinstance(error.value, StatusError) and error.value.kind == Kind.INVALID_ARGUMENT
    return error.value.field


# ------------------------------------------------------------------------------ ordering

def test_the_gate_releases_requests_in_sequence_order_whatever_order_they_arrive() -> None:
    gate: SequenceGate[str] = SequenceGate()
    assert gate.offer(3, "c", "r3") == []
    assert gate.offer(2, "b", "r2") == []
    assert gate.waiting == [2, 3]
    assert gate.offer(1, "a", "r1") == ["a", "b", "c"]
    assert gate.offer(4, "d", "r4") == ["d"]
    assert gate.next_seq == 5 and gate.waiting == []


def test_a_repeated_number_is_the_same_request() -> None:
    gate: SequenceGate[str] = SequenceGate()
    gate.offer(1, "a", "r1")
    assert gate.repeat_of(1) == "r1" and gate.repeat_of(2) is None
    with pytest.raises(StatusError) as e:
        gate.offer(1, "again", "r9")
    assert field_of(e) == "seq_id"


def test_an_unnumbered_request_runs_after_everything_taken() -> None:
    gate: SequenceGate[str] = SequenceGate()
    assert gate.offer(2, "b", "r2") == []
    assert gate.offer(None, "c", "r3") == []  # number 3: after the held 2
    assert gate.offer(1, "a", "r1") == ["a", "b", "c"]


# ------------------------------------------------------------------------------- futures

def test_a_future_is_pending_then_done_and_expires_after_keep_s() -> None:
    now = [0.0]
    store = FutureStore(keep_s=10, clock=lambda: now[0])
    rid = store.create("OptimStep")
    assert store.wait(rid, 0) == Pending("OptimStep")
    store.resolve(rid, {"metrics": {}})
    assert store.wait(rid, 0) == Done("OptimStep", {"metrics": {}})
    store.fail(rid, "late", user=True)  # a finished request keeps its outcome
    assert isinstance(store.peek(rid), Done)
    now[0] = 11.0
    store.create("Sample")  # creating sweeps expired entries
    with pytest.raises(KeyError):
        store.peek(rid)


def test_on_done_runs_at_once_when_finished_and_later_when_not() -> None:
    store = FutureStore()
    rid = store.create("Sample")
    calls: list[str] = []
    store.on_done(rid, lambda: calls.append("first"))
    assert calls == []
    store.fail(rid, "data[0].advantages: missing", user=True)
    assert calls == ["first"]
    store.on_done(rid, lambda: calls.append("second"))
    assert calls == ["first", "second"]
    assert store.peek(rid) == Failed("Sample", "data[0].advantages: missing", True)


def test_a_waiter_wakes_when_the_result_arrives() -> None:
    store = FutureStore()
    rid = store.create("ForwardBackward")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(store.wait(rid, 60)))
    waiter.start()
    store.resolve(rid, b"payload")
    waiter.join(60)
    assert got == [Done("ForwardBackward", b"payload")]


# ---------------------------------------------------------------------------- stop strings

def test_a_sample_is_cut_after_the_token_that_completes_a_stop_string() -> None:
    words = {1: "The", 2: " answer", 3: " is", 4: " 42", 5: ".", 6: "\n", 7: "More"}

    def decode(ids: list[int]) -> str:
        return "".join(words[i] for i in ids)

    assert cut_at_stop([1, 2, 3, 4, 5, 6, 7], [".\n"], decode) == 6
    assert cut_at_stop([1, 2, 3, 4, 5, 6, 7], ["is 4", "More"], decode) == 4
    assert cut_at_stop([1, 2, 3], ["nowhere"], decode) is None
    assert cut_at_stop([], ["x"], decode) is None


# ---------------------------------------------------------------------------------- paths

def test_tinker_paths_map_to_directories_under_the_root(tmp_path: Path) -> None:
    where = paths.parse("tinker://gs-1:train:0/sampler_weights/step-7")
    assert (where.model_id, where.kind, where.name) == ("gs-1:train:0", "sampler_weights",
                                                       "step-7")
    assert where.uri == "tinker://gs-1:train:0/sampler_weights/step-7"
    assert where.directory(tmp_path) == tmp_path / "gs-1-train-0" / "sampler_weights" / "step-7"


@pytest.mark.parametrize("uri", ["http://x/weights/a", "tinker://m/other/a", "tinker://m/weights",
                                 "tinker://m/weights/../x", "tinker://m/weights/a/b"])
def test_malformed_paths_are_refused_naming_the_field(uri: str) -> None:
    with pytest.raises(StatusError) as e:
        paths.parse(uri, "model_path")
    assert field_of(e) == "model_path"


def test_a_path_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(StatusError) as e:
        paths.parse("tinker://m/sampler_weights/a", "path", kind=paths.STATE)
    assert field_of(e) == "path" and "sampler_weights path" in e.value.problem


# --------------------------------------------------------------------------------- checks

def test_datums_are_checked_field_by_field() -> None:
    ok = Datum.of([1, 2, 3], [2, 3, 4], advantages=[0, 1, 1], sampling_logprobs=[0, -1, -2])
    check_datums([ok], LossSpec("importance_sampling"), vocab_size=10)
    cases = {
        "data[0].advantages": Datum.of([1, 2, 3], [2, 3, 4], sampling_logprobs=[0, 0, 0]),
        "data[0].sampling_logprobs": Datum.of([1, 2, 3], [2, 3, 4], advantages=[0, 0, 0],
                                              sampling_logprobs=[0, 0]),
        "data[0].target_ids": Datum.of([1, 2, 3], [2, 3, 40], advantages=[0, 0, 0],
                                       sampling_logprobs=[0, 0, 0]),
        "data[0].input_ids": Datum.of([], []),
    }
    for name, bad in cases.items():
        with pytest.raises(StatusError) as e:
            check_datums([bad], LossSpec("importance_sampling"), vocab_size=10)
        assert field_of(e) == name
    with pytest.raises(StatusError) as e:
        check_datums([ok, Datum.of([1], [2], weights=[np.nan])], LossSpec("cross_entropy"), 10)
    assert field_of(e) == "data[1].weights"
    with pytest.raises(StatusError) as e:
        check_datums([], LossSpec("cross_entropy"), 10)
    assert field_of(e) == "data"


def test_losses_settings_and_sampling_are_checked_naming_the_field() -> None:
    bad = {
        "loss_fn": lambda: LossSpec("gspo").check(),
        "loss_fn_config.beta": lambda: LossSpec("dro", beta=-1.0).check(),
        "loss_fn_config.clip_low_threshold": lambda: LossSpec("ppo", clip_low=1.5).check(),
        "loss_fn_config.clip_high_threshold": lambda: LossSpec("ppo", clip_high=0.5).check(),
        "adam_params.learning_rate": lambda: AdamSettings(lr=0).check(),
        "adam_params.beta2": lambda: AdamSettings(beta2=1.0).check(),
        "num_samples": lambda: SamplingSpec(n=0, max_tokens=4).check(),
        "sampling_params.top_p": lambda: SamplingSpec(n=1, max_tokens=4, top_p=0).check(),
        "sampling_params.stop": lambda: SamplingSpec(n=1, max_tokens=4,
                                                     stop_strings=("",)).check(),
        "lora_config.rank": lambda: LoraRequest(rank=0).check(),
        "lora_config": lambda: LoraRequest(train_attn=False, train_mlp=False).check(),
    }
    for name, call in bad.items():
        with pytest.raises(StatusError) as e:
            call()
        assert field_of(e) == name, name
