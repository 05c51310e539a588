"""The official Tinker SDK (``tinker``, installed by the ``tinker`` extra of gridrl-trainer)
against ``gridrl-trainer serve-api`` on the tiny llama, over TLS with a ``trainer``-scoped
gridrl token as ``TINKER_API_KEY``: the SDK's documented supervised loop (loss goes down; the
saved weights load in peft and mlx-lm and compute what the server samples with), the RL loop
of ``examples/tinker_rl_reverse_words.py`` for two steps, and clear errors for what gridrl
does not serve."""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from float_bounds import ROUNDING_REL, assert_close_to_largest

tinker = pytest.importorskip("tinker", reason="the Tinker SDK (gridrl-trainer[tinker])")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[3]

# The documented supervised example (tinker-cookbook docs/training-sampling.mdx): pig latin.
EXAMPLES = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
    {"input": "space exploration", "output": "ace-spay exploration-way"},
    {"input": "rubber duck", "output": "ubber-ray uck-day"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_llama_dir: Path, pki, creds) -> Iterator[dict]:
    """serve-api over TLS with the session's credentials; the SDK trusts the test CA
    (SSL_CERT_FILE) and sends the trainer token as its API key."""
    from service_procs import start_service

    tmp = tmp_path_factory.mktemp("serve-api")
    server = start_service(
        ["gridrl-trainer", "serve-api", "--model", str(tiny_llama_dir), "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--api-dir", str(tmp / "api"), "--threads", "1",
         "--max-models", "16",
         "--lora-alpha", "8", "--authorized-tokens", str(creds.authorized),
         "--tls-cert", pki.crt("server"), "--tls-key", pki.key("server")], tmp, "serve-api")
    env = {"SSL_CERT_FILE": pki.ca, "TINKER_BASE_URL": server.info["tinker_base_url"],
           "TINKER_API_KEY": "tml-" + creds.tokens["trainer"], "TINKER_TELEMETRY": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield {"url": server.info["tinker_base_url"], "dir": tmp / "api", "server": server,
               "model": str(tiny_llama_dir)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def process_example(example: dict, tokenizer) -> tinker.types.Datum:
    """As the SDK's documentation writes it."""
    types = tinker.types
    prompt = f"English: {example['input']}\nPig Latin:"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
    completion_tokens = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    tokens = prompt_tokens + completion_tokens
    weights = ([0] * len(prompt_tokens) + [1] * len(completion_tokens))[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                       loss_fn_inputs=dict(weights=weights, target_tokens=tokens[1:]))


@pytest.mark.mlx
@pytest.mark.slow
def test_the_documented_supervised_loop_learns_and_its_weights_load_in_peft_and_mlx(
        api: dict) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    types = tinker.types
    service_client = tinker.ServiceClient()
    names = [m.model_name for m in tinker.RestClient().get_server_capabilities().result()
             .supported_models]
    assert api["model"] in names
    training_client = service_client.create_lora_training_client(base_model=api["model"],
                                                                 rank=8).result()
    tokenizer = training_client.get_tokenizer()
    processed = [process_example(ex, tokenizer) for ex in EXAMPLES]
    losses = []
    for _ in range(6):
        fwdbwd_future = training_client.forward_backward(processed, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=5e-3))
        fwdbwd_result = fwdbwd_future.result()
        optim_future.result()
        logprobs = np.concatenate([o["logprobs"].tolist() for o in fwdbwd_result.loss_fn_outputs])
        weights = np.concatenate([e.loss_fn_inputs["weights"].tolist() for e in processed])
        losses.append(-np.dot(logprobs, weights) / weights.sum())
        assert fwdbwd_result.metrics["loss:sum"] == pytest.approx(-np.dot(logprobs, weights),
                                                                  rel=1e-4)
    assert losses[-1] < 0.8 * losses[0], losses

    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: coffee break\nPig Latin:"))
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"])
    result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8).result()
    assert len(result.sequences) == 8
    assert len({tuple(s.tokens) for s in result.sequences}) == 1  # greedy
    assert all(len(s.logprobs) == len(s.tokens) for s in result.sequences)

    saved = training_client.save_weights_for_sampler("pig-latin").result()
    model_id, kind, name = saved.path.removeprefix("tinker://").split("/")
    assert (model_id, kind, name) == (training_client.model_id, "sampler_weights", "pig-latin")
    folder = api["dir"] / model_id.replace(":", "-") / "sampler_weights" / "pig-latin"
    # the saved weights compute, in peft, what the server scores with them
    named = service_client.create_sampling_client(model_path=saved.path).result()
    ids = tokenizer.encode("English: donut shop\nPig Latin: onut-day op-shay")
    served = named.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    base = AutoModelForCausalLM.from_pretrained(api["model"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(folder / "peft")).eval()
    with torch.no_grad():
        logits = peft(torch.tensor([ids])).logits[0]
    local = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert served[0] is None
    np.testing.assert_allclose(served[1:], local.numpy(), rtol=0, atol=1e-4)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(api["model"], dtype=torch.float32)(
            torch.tensor([ids])).logits[0]
    assert float((plain - logits).abs().max()) > 1e-3  # the adapter is not the base model
    # and in mlx-lm, its mlx-lm copy
    import mlx.core as mx
    from mlx_lm import load

    mlx_model, _ = load(api["model"], adapter_path=str(folder / "mlx"))
    got = np.array(mlx_model(mx.array([ids]))[0])
    assert np.abs(got - logits.numpy()).max() <= 1e-4 * float(logits.abs().max())
    service_client.close("success").result()


def test_the_rl_example_runs_through_the_sdk(api: dict, tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import tinker_rl_reverse_words as example
    finally:
        sys.path.pop(0)
    out = tmp_path / "record.json"
    record = example.main(["--model", api["model"], "--steps", "2", "--eval-every", "1",
                           "--eval-tasks", "4", "--max-tokens", "6", "--group-size", "4",
                           "--rank", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert [e[0] for e in record["evals"]] == [0, 1, 2]
    assert all(0 <= e[1] <= 1 for e in record["evals"])
    assert [s["step"] for s in record["steps"]] == [1, 2]


def test_credentials_are_checked_as_on_every_gridrl_server(api: dict, pki, creds) -> None:
    def post(key: str | None) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        return httpx.post(f"{api['url']}/api/v1/client/config", json={"sdk_version": "0.38.0"},
                          headers=headers, verify=pki.ca, timeout=30)

    assert post("tml-" + creds.tokens["trainer"]).status_code == 200
    assert post(creds.tokens["trainer"]).status_code == 200  # the tml- prefix is optional
    no_key, wrong, reader = post(None), post("tml-" + creds.tokens["wrong"]), post(
        "tml-" + creds.tokens["read"])
    assert (no_key.status_code, wrong.status_code, reader.status_code) == (401, 401, 403)
    assert "TINKER_API_KEY=tml-" in no_key.json()["error"]
    assert "scope read" in reader.json()["error"]
    assert httpx.get(f"{api['url']}/api/v1/healthz", verify=pki.ca).json() == {"status": "ok"}
    with pytest.raises(tinker.AuthenticationError):  # the SDK says so at once
        tinker.ServiceClient(api_key="tml-" + creds.tokens["wrong"]).create_lora_training_client(
            base_model=api["model"], rank=4).result(timeout=60)


def test_what_gridrl_does_not_serve_is_refused_by_name_never_a_hang(api: dict, pki,
                                                                    creds) -> None:
    headers = {"X-API-Key": "tml-" + creds.tokens["trainer"]}

    def call(method: str, path: str) -> httpx.Response:
        return httpx.request(method, f"{api['url']}/api/v1/{path}", json={}, headers=headers,
                             verify=pki.ca, timeout=30)

    billing = call("GET", "billing/usage/events")
    assert billing.status_code == 400 and "billing" in billing.json()["error"]
    publish = call("POST", "training_runs/r:train:0/checkpoints/weights/x/publish")
    assert publish.status_code == 400 and "publishing" in publish.json()["error"]
    assert call("POST", "no_such_endpoint").status_code == 404

    types = tinker.types
    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=api["model"],
                                                                 rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 2]})
    with pytest.raises(tinker.BadRequestError, match="'gspo' is not supported by gridrl"):
        training_client.forward_backward([datum], "gspo").result(timeout=60)
    service_client.close("success").result()


def test_after_any_refused_call_the_training_client_goes_on(api: dict) -> None:
    """The defect of issue 46: one refused call (``forward_backward(data, "cispo")`` answered
    400) left every later call of that training client waiting forever, the server waiting
    for the refused request's place in the model's order. Every kind of refusal is tried; the
    client's next forward-backward and optimizer step still answer."""
    types = tinker.types
    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=api["model"],
                                                                 rank=4).result(timeout=120)
    good = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 2],
                                        "weights": [0.0, 1.0, 1.0, 1.0]})]
    short = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                         loss_fn_inputs={"target_tokens": [6, 7]})]
    refusals = {
        "a loss gridrl does not serve": (
            lambda: training_client.forward_backward(good, "gspo"), "'gspo'"),
        "an input no loss reads": (lambda: training_client.forward_backward(
            [types.Datum(model_input=good[0].model_input, loss_fn_inputs={
                "target_tokens": [6, 7, 8, 2], "mask": [1.0] * 4})], "cross_entropy"),
            "mask"),
        "targets of the wrong length": (
            lambda: training_client.forward_backward(short, "cross_entropy"), "data[0]"),
        "advantages missing": (
            lambda: training_client.forward_backward(good, "importance_sampling"),
            "advantages"),
        "an optimizer setting out of range": (lambda: training_client.optim_step(
            types.AdamParams(learning_rate=1e-3, beta2=1.5)), "beta2"),
        "a bad checkpoint name": (lambda: training_client.save_state("../escape"), "path"),
        "an unknown checkpoint": (lambda: training_client.load_state(
            "tinker://nope:train:0/weights/gone"), "tinker://nope:train:0/weights/gone"),
        "a feature gridrl does not serve": (lambda: training_client.save_weights_external(
            "merged", age_encryption_recipients=["age1qqqq"]), "age_encryption_recipients"),
    }
    for what, (refused, named) in refusals.items():
        with pytest.raises(Exception, match=named.replace("[", r"\[").replace("(", r"\(")):
            refused().result(timeout=60)
        step = training_client.forward_backward(good, "cross_entropy")
        optim = training_client.optim_step(types.AdamParams(learning_rate=1e-3))
        assert step.result(timeout=60).metrics["loss:sum"] > 0, what
        assert optim.result(timeout=60) is not None, what
    gone = "tinker://nope:train:0/weights/gone"
    with pytest.raises(tinker.NotFoundError, match=gone):  # 404 at once, naming the path
        service_client.create_training_client_from_state(gone).result(timeout=60)
    service_client.close("success").result()


def test_the_rest_client_lists_runs_and_checkpoints_honours_ttls_and_deletes(api: dict) -> None:
    """RestClient on the trainer's disk: runs, sessions and checkpoints listed, weights info,
    file URLs of an export, a TTL that the server honours (the files are deleted), deletion,
    and 404 naming the path for what is gone."""
    import time

    types = tinker.types
    service_client = tinker.ServiceClient()
    rest = service_client.create_rest_client()
    training_client = service_client.create_lora_training_client(
        base_model=api["model"], rank=4, train_mlp=False,
        user_metadata={"who": "tinker-test"}).result(timeout=120)
    run_id = training_client.model_id
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 2],
                                        "advantages": [0.5, -0.2, 1.0, 0.3],
                                        "logprobs": [-2.0, -3.0, -1.5, -2.5]})
    for loss, config in (("cispo", {"clip_low_threshold": 0.9}), ("dro", {"beta": 0.1})):
        out = training_client.forward_backward([datum], loss, loss_fn_config=config).result(
            timeout=60)
        assert np.isfinite(out.metrics["loss:sum"]), loss
    training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    state = training_client.save_state("s1").result(timeout=60).path
    sampler = training_client.save_weights_for_sampler("w1").result(timeout=60).path
    export = training_client.save_weights_external("e1").result(timeout=60).path
    assert export == f"tinker://{run_id}/external_weights/e1"

    run = rest.get_training_run(run_id).result(timeout=30)
    assert (run.training_run_id, run.base_model, run.lora_rank) == (run_id, api["model"], 4)
    assert run.user_metadata == {"who": "tinker-test"}
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(sampler).result(timeout=30).training_run_id == \
        run_id
    assert run_id in [r.training_run_id for r in
                      rest.list_training_runs().result(timeout=30).training_runs]
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result(timeout=30)
              .checkpoints}
    assert set(listed) == {state, sampler, export}
    assert listed[state].checkpoint_type == "training" and listed[state].size_bytes > 0
    assert state in [c.tinker_path for c in
                     rest.list_user_checkpoints().result(timeout=30).checkpoints]
    info = rest.get_weights_info_by_tinker_path(state).result(timeout=30)
    assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp) == (
        api["model"], 4, True, False)
    urls = rest.get_external_weights_urls(export).result(timeout=30).urls
    assert {"peft/adapter_config.json", "mlx/adapters.safetensors"} <= set(urls)
    assert all(Path(u.removeprefix("file://")).is_file() for u in urls.values())
    session_id = service_client.holder.get_session_id()
    assert session_id in rest.list_sessions().result(timeout=30).sessions
    assert run_id in rest.get_session(session_id).result(timeout=30).training_run_ids

    # a resumed run with its optimizer state, on a client of its own
    resumed = service_client.create_training_client_from_state_with_optimizer(state).result(
        timeout=120)
    assert resumed.model_id != run_id
    assert resumed.forward_backward([datum], "cross_entropy").result(timeout=60)

    rest.set_checkpoint_ttl_from_tinker_path(sampler, 1).result(timeout=30)
    folder = api["dir"] / run_id.replace(":", "-") / "sampler_weights" / "w1"
    deadline = time.monotonic() + 60  # a hang guard: the server sweeps every few seconds
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not folder.exists()  # deleted by the server, nobody asked
    rest.delete_checkpoint_from_tinker_path(state).result(timeout=30)
    for gone in (state, sampler):
        with pytest.raises(tinker.NotFoundError, match=gone):
            rest.get_weights_info_by_tinker_path(gone).result(timeout=30)
    with pytest.raises(tinker.NotFoundError, match=state):
        service_client.create_training_client_from_state(state).result(timeout=60)
    with pytest.raises(tinker.NotFoundError, match=sampler):
        service_client.create_sampling_client(model_path=sampler).result(timeout=60)
    assert set(c.tinker_path for c in rest.list_checkpoints(run_id).result(timeout=30)
               .checkpoints) == {export}
    service_client.close("success").result()


def test_topk_prompt_logprobs_and_two_training_clients_each_with_its_own_lora(api: dict) -> None:
    """Top-k prompt logprobs are the base model's own (peft-free transformers forward), the
    prompt token's logprob is among them where it ranks in the top k; two training clients
    on one base model train their own adapters (one's step does not move the other's)."""
    import torch
    from transformers import AutoModelForCausalLM

    types = tinker.types
    service_client = tinker.ServiceClient()
    ids = [5, 17, 9, 33, 2, 41]
    sampler = service_client.create_sampling_client(base_model=api["model"])
    response = sampler.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(
        max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3).result(timeout=60)
    topk = response.topk_prompt_logprobs
    assert len(topk) == len(ids) and topk[0] is None and all(len(r) == 3 for r in topk[1:])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(api["model"], dtype=torch.float32)(
            torch.tensor([ids[:-1]])).logits[0]
    want = torch.log_softmax(logits, -1).topk(3, -1)
    for i, row in enumerate(topk[1:]):
        assert [t for t, _ in row] == want.indices[i].tolist()
        np.testing.assert_allclose([lp for _, lp in row], want.values[i].numpy(), rtol=0,
                                   atol=1e-4)
    plain = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=60)
    assert plain[0] is None
    for i, row in enumerate(topk[1:]):
        ranked = dict(row)
        if ids[i + 1] in ranked:
            assert plain[i + 1] == pytest.approx(ranked[ids[i + 1]], abs=1e-4)

    first = service_client.create_lora_training_client(base_model=api["model"], rank=4).result(
        timeout=120)
    second = service_client.create_lora_training_client(base_model=api["model"], rank=8).result(
        timeout=120)
    assert first.model_id != second.model_id
    assert (first.get_info().lora_rank, second.get_info().lora_rank) == (4, 8)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:]})
    before = second.forward([datum], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    for _ in range(3):
        first.forward_backward([datum], "cross_entropy")
        first.optim_step(types.AdamParams(learning_rate=5e-2))
    moved = first.forward([datum], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    after = second.forward([datum], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    assert moved < before  # the first one learned
    assert after == pytest.approx(before, rel=1e-6)  # the second one's adapter did not move
    service_client.close("success").result()


def _peft_logprobs(model_dir: str, adapter_dir: Path | None, ids: list[int]) -> np.ndarray:
    """log p(ids[t + 1] | ids[:t + 1]) from transformers (+ the peft adapter), float32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1),
                                         torch.tensor(ids[1:])].numpy()


@pytest.mark.mlx
def test_train_unembed_adapts_the_output_head_and_exports_it_in_peft_and_mlx(api: dict) -> None:
    """``train_unembed=True`` (the SDK's default) puts a LoRA on lm_head: two clients of one
    seed, with and without it, start equal (B = 0) and take the same step; the gradient that
    reaches the head's LoRA makes the one with it score the data better than the one without.
    Its samples (the trainer's sampler) and its peft and mlx-lm exports compute the same
    logprobs."""
    from safetensors.numpy import load_file

    types = tinker.types
    service_client = tinker.ServiceClient()
    head, plain = (service_client.create_lora_training_client(
        base_model=api["model"], rank=4, seed=7, train_unembed=unembed).result(timeout=120)
        for unembed in (True, False))
    ids = [1, 17, 9, 33, 21, 41, 12, 8, 30, 2]
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:]})]

    def logprobs(client: Any) -> np.ndarray:
        out = client.forward(data, "cross_entropy").result(timeout=60)
        return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())

    before = logprobs(head)
    assert_close_to_largest(before, logprobs(plain), ROUNDING_REL, "B = 0: both are the base")
    for client in (head, plain):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    with_head, without = logprobs(head), logprobs(plain)
    # the blocks took the same step (same seed, same gradient: the head's LoRA added nothing
    # to the forward at B = 0); the head's own step is one more descent step
    gap = float(with_head.sum() - without.sum())
    assert gap > 10 * ROUNDING_REL * float(np.abs(without).sum()), gap

    folders, paths, rest = {}, {}, tinker.RestClient()
    for name, client in (("head", head), ("plain", plain)):
        saved = client.save_weights_for_sampler(name).result(timeout=60)
        folders[name] = (api["dir"] / client.model_id.replace(":", "-") / "sampler_weights"
                         / name)
        info = rest.get_weights_info_by_tinker_path(saved.path).result(timeout=60)
        assert info.train_unembed is (name == "head")
        paths[name] = saved.path
    peft_dir, mlx_dir = folders["head"] / "peft", folders["head"] / "mlx"
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert "lm_head" in config["target_modules"]
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    assert {"base_model.model.lm_head.lora_A.weight",
            "base_model.model.lm_head.lora_B.weight"} <= set(tensors)
    assert not any("lm_head" in k for k in load_file(
        folders["plain"] / "peft" / "adapter_model.safetensors"))
    # the peft export computes what the server scores with the weights
    local = _peft_logprobs(api["model"], peft_dir, ids)
    assert_close_to_largest(local, with_head, ROUNDING_REL, "peft export vs forward")
    assert_close_to_largest(_peft_logprobs(api["model"], folders["plain"] / "peft", ids),
                            without, ROUNDING_REL, "peft export without the head")
    # and the server's samplers use the head's LoRA (the trainer's own sampler here)
    sampler = service_client.create_sampling_client(model_path=paths["head"])
    served = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=60)
    assert served[0] is None
    assert_close_to_largest(served[1:], local, ROUNDING_REL, "sampler vs peft export")
    live = head.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = types.ModelInput.from_ints(ids[:5])
    result = live.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=5, temperature=0.0)).result(timeout=60)
    sample = result.sequences[0]
    want = _peft_logprobs(api["model"], peft_dir, ids[:5] + list(sample.tokens))[4:]
    assert_close_to_largest(sample.logprobs, want, ROUNDING_REL, "sampled tokens' logprobs")
    # the mlx-lm copy: key "lm_head", tensors lm_head.lora_a / lora_b, the same logits
    mlx_config = json.loads((mlx_dir / "adapter_config.json").read_text())
    assert "lm_head" in mlx_config["lora_parameters"]["keys"]
    assert {"lm_head.lora_a", "lm_head.lora_b"} <= set(load_file(mlx_dir / "adapters.safetensors"))
    import mlx.core as mx
    import torch
    from mlx_lm import load
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            api["model"], dtype=torch.float32), str(peft_dir)).eval()(
            torch.tensor([ids])).logits[0].numpy()
    mlx_model, _ = load(api["model"], adapter_path=str(mlx_dir))
    got = np.array(mlx_model(mx.array([ids]))[0])
    assert np.abs(got - logits).max() <= 1e-4 * float(np.abs(logits).max())
    service_client.close("success").result()


# What owned machines cannot serve (refused at once, by name) and what never reaches the server
REFUSED = {
    "ServiceClient.copy_weights", "RestClient.copy_weights",
    "RestClient.copy_weights_async", "RestClient.publish_checkpoint_from_tinker_path",
    "RestClient.publish_checkpoint_from_tinker_path_async",
    "RestClient.unpublish_checkpoint_from_tinker_path",
    "RestClient.unpublish_checkpoint_from_tinker_path_async", "RestClient.get_audit_log",
    "RestClient.get_audit_log_async", "RestClient.get_billing_usage",
    "RestClient.get_billing_usage_async", "RestClient.search_sessions",
    "RestClient.export_session_trace", "RestClient.export_session_trace_async",
    "RestClient.assign_session_project", "RestClient.assign_session_project_async",
    "RestClient.whoami",
}
CLIENT_SIDE = {"ServiceClient.get_console_url", "TrainingClient.get_console_url",
               "ServiceClient.get_telemetry", "TrainingClient.get_telemetry",
               "SamplingClient.get_telemetry", "RestClient.get_telemetry",
               "SamplingClient.on_queue_state_change"}
CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")


def public_methods() -> list[str]:
    """Every public method of the SDK's four clients (their ``_async`` twins included)."""
    import inspect

    return [f"{c}.{n}" for c in CLASSES for n, v in inspect.getmembers(getattr(tinker, c))
            if not n.startswith("_") and callable(v)]


def _short(message: str) -> str:
    """A refusal as the table shows it: the server's message without the SDK's wrapping."""
    message = re.sub(r"^(\w+): Error code: (\d+) - \{'error': ['\"](.*)['\"]\}$", r"\1 \2: \3",
                     message)
    return message.replace("|", "/")[:300]


def _resolve(value: Any) -> Any:
    """Wait for what a method answered: a coroutine (awaited, then its future), a future."""
    import asyncio
    import inspect

    if inspect.isawaitable(value):
        async def settle(v: Any) -> Any:
            out = await v
            while inspect.isawaitable(out) and not hasattr(out, "model_id"):
                out = await out
            return out
        value = asyncio.run(settle(value))
    if hasattr(value, "result") and callable(value.result) and not isinstance(value, dict):
        value = value.result(timeout=120)
    return value


def test_every_public_sdk_method_works_or_is_refused_by_name(api: dict) -> None:
    """Walks all public methods of ServiceClient, TrainingClient, SamplingClient and
    RestClient against serve-api; prints the table (and writes it to
    ``$GRIDRL_TINKER_TABLE`` when set: docs/tinker_methods.md is this output). A method
    either works, or is refused at once with a message naming what owned machines do not
    have, or never reaches the server (the SDK answers it itself)."""
    import time
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    types = tinker.types
    sc = tinker.ServiceClient()
    rest = sc.create_rest_client()
    tc = sc.create_lora_training_client(base_model=api["model"], rank=4).result(timeout=120)
    run = tc.model_id
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 2]})
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    adam = types.AdamParams(learning_rate=1e-3)
    state = tc.save_state("walk").result(timeout=60).path
    weights = tc.save_weights_for_sampler("walk").result(timeout=60).path
    sampler = sc.create_sampling_client(base_model=api["model"])
    session = sc.holder.get_session_id()
    sampler_id = json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))[
        "sampling_session_id"]

    def custom(data: list, logprobs: list) -> tuple:
        loss = sum(-lp.sum() for lp in logprobs)
        return loss, {"custom": float(loss)}

    def save(name: str) -> str:
        return tc.save_state(name).result(timeout=60).path

    def copy_elsewhere(path: str) -> Any:
        other = tinker.ServiceClient(project_id="elsewhere")
        try:
            return other.copy_weights(path).result(timeout=60)
        finally:
            other.close("success").result(timeout=60)

    def per_datum_loss(logprobs: Any, advantages: Any) -> Any:
        return -(logprobs * advantages).sum(), {}

    calls: dict[str, Callable[[], Any]] = {
        "ServiceClient.get_server_capabilities": sc.get_server_capabilities,
        "ServiceClient.get_server_capabilities_async": sc.get_server_capabilities_async,
        "ServiceClient.create_lora_training_client": lambda: sc.create_lora_training_client(
            base_model=api["model"], rank=2),
        "ServiceClient.create_lora_training_client_async": lambda: (
            sc.create_lora_training_client_async(base_model=api["model"], rank=2)),
        "ServiceClient.create_training_client_from_state": lambda: (
            sc.create_training_client_from_state(state)),
        "ServiceClient.create_training_client_from_state_async": lambda: (
            sc.create_training_client_from_state_async(state)),
        "ServiceClient.create_training_client_from_state_with_optimizer": lambda: (
            sc.create_training_client_from_state_with_optimizer(state)),
        "ServiceClient.create_training_client_from_state_with_optimizer_async": lambda: (
            sc.create_training_client_from_state_with_optimizer_async(state)),
        "ServiceClient.create_sampling_client": lambda: sc.create_sampling_client(
            model_path=weights),
        "ServiceClient.create_sampling_client_async": lambda: sc.create_sampling_client_async(
            base_model=api["model"]),
        "ServiceClient.create_rest_client": sc.create_rest_client,
        "ServiceClient.copy_weights": lambda: copy_elsewhere(state),
        "ServiceClient.create_custom_loss": lambda: sc.create_custom_loss(
            per_datum_loss, {"logprobs": 1, "advantages": 1}),
        "ServiceClient.get_console_url": sc.get_console_url,
        "ServiceClient.get_telemetry": sc.get_telemetry,
        "TrainingClient.forward": lambda: tc.forward([datum], "cross_entropy"),
        "TrainingClient.forward_async": lambda: tc.forward_async([datum], "cross_entropy"),
        "TrainingClient.forward_backward": lambda: tc.forward_backward([datum], "cross_entropy"),
        "TrainingClient.forward_backward_async": lambda: tc.forward_backward_async(
            [datum], "cross_entropy"),
        "TrainingClient.forward_backward_custom": lambda: tc.forward_backward_custom(
            [datum], custom),
        "TrainingClient.forward_backward_custom_async": lambda: (
            tc.forward_backward_custom_async([datum], custom)),
        "TrainingClient.optim_step": lambda: tc.optim_step(adam),
        "TrainingClient.optim_step_async": lambda: (
            tc.forward_backward([datum], "cross_entropy").result(timeout=60)
            and tc.optim_step_async(adam)),
        "TrainingClient.save_state": lambda: tc.save_state("walk-2", ttl_seconds=3600),
        "TrainingClient.save_state_async": lambda: tc.save_state_async("walk-3"),
        "TrainingClient.load_state": lambda: tc.load_state(state),
        "TrainingClient.load_state_async": lambda: tc.load_state_async(state),
        "TrainingClient.load_state_with_optimizer": lambda: tc.load_state_with_optimizer(state),
        "TrainingClient.load_state_with_optimizer_async": lambda: (
            tc.load_state_with_optimizer_async(state)),
        "TrainingClient.save_weights_for_sampler": lambda: tc.save_weights_for_sampler("walk-2"),
        "TrainingClient.save_weights_for_sampler_async": lambda: (
            tc.save_weights_for_sampler_async("walk-3")),
        "TrainingClient.save_weights_and_get_sampling_client": (
            tc.save_weights_and_get_sampling_client),
        "TrainingClient.save_weights_and_get_sampling_client_async": (
            tc.save_weights_and_get_sampling_client_async),
        "TrainingClient.save_weights_external": lambda: tc.save_weights_external("walk"),
        "TrainingClient.save_weights_external_async": lambda: (
            tc.save_weights_external_async("walk-2")),
        "TrainingClient.create_sampling_client": lambda: tc.create_sampling_client(weights),
        "TrainingClient.create_sampling_client_async": lambda: (
            tc.create_sampling_client_async(weights)),
        "TrainingClient.get_info": tc.get_info,
        "TrainingClient.get_info_async": tc.get_info_async,
        "TrainingClient.get_tokenizer": tc.get_tokenizer,
        "TrainingClient.get_console_url": tc.get_console_url,
        "TrainingClient.get_telemetry": tc.get_telemetry,
        "SamplingClient.sample": lambda: sampler.sample(prompt, 2, params),
        "SamplingClient.sample_async": lambda: sampler.sample_async(prompt, 2, params),
        "SamplingClient.compute_logprobs": lambda: sampler.compute_logprobs(prompt),
        "SamplingClient.compute_logprobs_async": lambda: sampler.compute_logprobs_async(prompt),
        "SamplingClient.create": lambda: tinker.SamplingClient.create(
            sc.holder, base_model=api["model"]),
        "SamplingClient.get_sampler_handle": sampler.get_sampler_handle,
        "SamplingClient.from_sampler_handle": lambda: tinker.SamplingClient.from_sampler_handle(
            sampler.get_sampler_handle()).compute_logprobs(prompt),
        "SamplingClient.get_base_model": sampler.get_base_model,
        "SamplingClient.get_base_model_async": sampler.get_base_model_async,
        "SamplingClient.get_tokenizer": sampler.get_tokenizer,
        "SamplingClient.get_telemetry": sampler.get_telemetry,
        "SamplingClient.on_queue_state_change": lambda: sampler.on_queue_state_change(
            "active", None),
        "RestClient.get_server_capabilities": rest.get_server_capabilities,
        "RestClient.get_training_run": lambda: rest.get_training_run(run),
        "RestClient.get_training_run_async": lambda: rest.get_training_run_async(run),
        "RestClient.get_training_run_by_tinker_path": lambda: (
            rest.get_training_run_by_tinker_path(state)),
        "RestClient.get_training_run_by_tinker_path_async": lambda: (
            rest.get_training_run_by_tinker_path_async(state)),
        "RestClient.get_weights_info_by_tinker_path": lambda: (
            rest.get_weights_info_by_tinker_path(state)),
        "RestClient.list_training_runs": rest.list_training_runs,
        "RestClient.list_training_runs_async": rest.list_training_runs_async,
        "RestClient.list_checkpoints": lambda: rest.list_checkpoints(run),
        "RestClient.list_checkpoints_async": lambda: rest.list_checkpoints_async(run),
        "RestClient.list_user_checkpoints": rest.list_user_checkpoints,
        "RestClient.list_user_checkpoints_async": rest.list_user_checkpoints_async,
        "RestClient.get_external_weights_urls": lambda: rest.get_external_weights_urls(
            f"tinker://{run}/external_weights/walk"),
        "RestClient.get_external_weights_urls_async": lambda: (
            rest.get_external_weights_urls_async(f"tinker://{run}/external_weights/walk")),
        "RestClient.set_checkpoint_ttl_from_tinker_path": lambda: (
            rest.set_checkpoint_ttl_from_tinker_path(state, 3600)),
        "RestClient.set_checkpoint_ttl_from_tinker_path_async": lambda: (
            rest.set_checkpoint_ttl_from_tinker_path_async(state, None)),
        "RestClient.delete_checkpoint": lambda: rest.delete_checkpoint(
            run, "weights/" + save("del-1").rsplit("/", 1)[-1]),
        "RestClient.delete_checkpoint_async": lambda: rest.delete_checkpoint_async(
            run, "weights/" + save("del-2").rsplit("/", 1)[-1]),
        "RestClient.delete_checkpoint_from_tinker_path": lambda: (
            rest.delete_checkpoint_from_tinker_path(save("del-3"))),
        "RestClient.delete_checkpoint_from_tinker_path_async": lambda: (
            rest.delete_checkpoint_from_tinker_path_async(save("del-4"))),
        "RestClient.get_session": lambda: rest.get_session(session),
        "RestClient.get_session_async": lambda: rest.get_session_async(session),
        "RestClient.list_sessions": rest.list_sessions,
        "RestClient.list_sessions_async": rest.list_sessions_async,
        "RestClient.get_sampler": lambda: rest.get_sampler(sampler_id),
        "RestClient.get_sampler_async": lambda: rest.get_sampler_async(sampler_id),
        "RestClient.get_current_checkpoint_storage_usage": (
            rest.get_current_checkpoint_storage_usage),
        "RestClient.get_current_checkpoint_storage_usage_async": (
            rest.get_current_checkpoint_storage_usage_async),
        "RestClient.copy_weights": lambda: rest.copy_weights(state, "elsewhere"),
        "RestClient.copy_weights_async": lambda: rest.copy_weights_async(state, "elsewhere"),
        "RestClient.publish_checkpoint_from_tinker_path": lambda: (
            rest.publish_checkpoint_from_tinker_path(state)),
        "RestClient.publish_checkpoint_from_tinker_path_async": lambda: (
            rest.publish_checkpoint_from_tinker_path_async(state)),
        "RestClient.unpublish_checkpoint_from_tinker_path": lambda: (
            rest.unpublish_checkpoint_from_tinker_path(state)),
        "RestClient.unpublish_checkpoint_from_tinker_path_async": lambda: (
            rest.unpublish_checkpoint_from_tinker_path_async(state)),
        "RestClient.get_audit_log": rest.get_audit_log,
        "RestClient.get_audit_log_async": rest.get_audit_log_async,
        "RestClient.get_billing_usage": lambda: rest.get_billing_usage("2026-01-01",
                                                                      "2026-02-01"),
        "RestClient.get_billing_usage_async": lambda: rest.get_billing_usage_async(
            "2026-01-01", "2026-02-01"),
        "RestClient.search_sessions": lambda: rest.search_sessions(
            types.SessionSearchRequest()),
        "RestClient.export_session_trace": lambda: rest.export_session_trace(session),
        "RestClient.export_session_trace_async": lambda: rest.export_session_trace_async(
            session),
        "RestClient.assign_session_project": lambda: rest.assign_session_project(session, "p"),
        "RestClient.assign_session_project_async": lambda: rest.assign_session_project_async(
            session, "p"),
        "RestClient.whoami": rest.whoami,
        "RestClient.get_telemetry": rest.get_telemetry,
        "ServiceClient.close": lambda: sc.close("success"),  # last: it ends the session
    }
    assert sorted(calls) == sorted(public_methods())  # every method, no more
    rows = []
    for name, call in calls.items():
        started = time.monotonic()
        try:
            _resolve(call())
            outcome, detail = ("client-side" if name in CLIENT_SIDE else "works"), ""
        except Exception as e:
            outcome, detail = "refused", f"{type(e).__name__}: {e}".replace("\n", " ")
        rows.append((name, outcome, detail, time.monotonic() - started))
    table = ["| method | outcome | message |", "| --- | --- | --- |"]
    table += [f"| `{n}` | {o} | {_short(d)} |" for n, o, d, _ in rows]
    counts = {o: sum(r[1] == o for r in rows) for o in ("works", "refused", "client-side")}
    summary = (f"{len(rows)} public methods (tinker {tinker.__version__}): "
               f"{counts['works']} work, {counts['refused']} refused by name, "
               f"{counts['client-side']} answered by the SDK itself")
    text = "\n".join([summary, "", *table, ""])
    print(text)
    if os.environ.get("GRIDRL_TINKER_TABLE"):
        Path(os.environ["GRIDRL_TINKER_TABLE"]).write_text(text)
    failed = {n: d for n, o, d, _ in rows if o == "refused" and n not in REFUSED}
    assert not failed, failed
    assert {n for n, o, _, _ in rows if o == "refused"} == REFUSED
    for name, _, detail, took in rows:
        if name in REFUSED:
            assert took < 30, (name, took)  # at once, never a hang
            assert any(word in detail for word in (
                "not supported by gridrl", "JWT")), (name, detail)
