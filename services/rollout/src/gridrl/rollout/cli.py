"""``gridrl-rollout``: serve a rollout node, or talk to one.

    gridrl-rollout serve --backend torch --model smollm2-135m-instruct [--master m:50050]
        [--listen 0.0.0.0:50051 --tls-cert C --tls-key K --tls-ca CA
         --authorized-tokens FILE --auth-token-file NODE_TOKEN] [--openai-listen 127.0.0.1:8000]
    gridrl-rollout serve --backend vllm --vllm-url http://127.0.0.1:8000 --model DIR
    gridrl-rollout generate --address 127.0.0.1:50051 --prompt "Hi" --n 4 --max-tokens 32
    gridrl-rollout push-adapter --address 127.0.0.1:50051 runs/a/adapter --version 3
    gridrl-rollout reload-adapter --address 127.0.0.1:50051 (--version 3 | --path P | --base)
    gridrl-rollout info --address 127.0.0.1:50051 [--json]
    gridrl-rollout cache [--prune]

Imports stay light (click, grpc, protobuf): torch and mlx are imported only inside ``serve``,
so ``--help`` is instant. Every client command takes ``--tls-ca``/``--tls-cert``/``--tls-key``
and ``--auth-token-file`` (:func:`gridrl.common.cli.client_security_options`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import click

from gridrl.common.cli import (
    client_security_options,
    env_option,
    exit_on_rpc_error,
    print_json,
    renamed_option,
    server_options,
    setup_logging,
    write_ready_file,
)
from gridrl.common.security import Security

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_FINISH = {1: "stop", 2: "length"}


def _address_option(command: str):
    return env_option("--address", env="GRIDRL_ROLLOUT_ADDRESS", default="127.0.0.1:50051",
                      help=f"host:port of the rollout node to {command}.")


def _timeout_option(command: str, default: float):
    def decorate(f):
        f = renamed_option("--timeout", "timeout", env=f"GRIDRL_ROLLOUT_{command}_TIMEOUT",
                           type=click.FloatRange(min=0, min_open=True))(f)
        return env_option("--timeout-s", "timeout", env=f"GRIDRL_ROLLOUT_{command}_TIMEOUT_S",
                          default=default, type=click.FloatRange(min=0, min_open=True),
                          help="Seconds to wait for the node.")(f)

    return decorate


def _json_option(command: str):
    return env_option("--json", "as_json", env=f"GRIDRL_ROLLOUT_{command}_JSON", is_flag=True,
                      default=False, help="Print the response as JSON.")


def _check_device(ctx, param, value: str) -> str:
    if not _DEVICE.match(value):
        raise click.BadParameter(f"{value!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gridrl rollout node: samples completions with behaviour logprobs, takes adapters."""


@main.command()
@server_options("rollout", listen="127.0.0.1:50051", metrics_port=9401, client=True)
@env_option("--backend", env="GRIDRL_ROLLOUT_BACKEND", default="torch",
            type=click.Choice(["torch", "mlx", "vllm"]),
            help="Inference backend (vllm: front a vLLM server on this machine, --vllm-url).")
@env_option("--model", env="GRIDRL_ROLLOUT_MODEL", default="smollm2-135m-instruct",
            help="Hub id, local directory, or alias (smollm2-135m-instruct works offline); "
                 "vllm: the model vLLM serves (tokenizer and config are read from it).")
@env_option("--vllm-url", env="GRIDRL_ROLLOUT_VLLM_URL", default=None, show_default=False,
            help="vllm: base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8000 (vLLM "
                 "reads pushed adapters from this machine's --adapter-root).")
@env_option("--vllm-api-key-file", env="GRIDRL_ROLLOUT_VLLM_API_KEY_FILE", default=None,
            show_default=False, type=click.Path(exists=True, dir_okay=False),
            help="vllm: file holding one of vLLM's --api-key values.")
@env_option("--device", env="GRIDRL_ROLLOUT_DEVICE", default="auto", callback=_check_device,
            help="auto, cpu, cuda, cuda:N or mps (mlx: auto, cpu, or mps for the Apple GPU).")
@env_option("--dtype", env="GRIDRL_ROLLOUT_DTYPE", default="auto",
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            help="Compute dtype (auto: float32 on CPU, bfloat16 on CUDA; mlx: as stored).")
@env_option("--forward", env="GRIDRL_ROLLOUT_FORWARD", default="lean",
            type=click.Choice(["lean", "transformers"]),
            help="torch: lean runs llama-family models through gridrl's fused forward "
                 "(prepacked weights on CPU, adapters as LoRA factors); transformers runs the "
                 "model's own forward with adapters merged. Other architectures always use "
                 "transformers.")
@env_option("--threads", env="GRIDRL_ROLLOUT_THREADS", default=0, type=click.IntRange(min=0),
            help="torch intra-op CPU threads (0: torch's default, one per core). Idle OpenMP "
                 "threads spin briefly, then sleep (GOMP_SPINCOUNT=10000 unless set); on a "
                 "machine shared with other jobs 1 thread can still be faster.")
@env_option("--capacity", env="GRIDRL_ROLLOUT_CAPACITY", default=64,
            type=click.IntRange(min=1), help="Most sequences decoded together in one batch.")
@env_option("--max-queue", env="GRIDRL_ROLLOUT_MAX_QUEUE", default=128,
            type=click.IntRange(min=1),
            help="Most Generate requests waiting; past it they get RESOURCE_EXHAUSTED.")
@env_option("--max-n", env="GRIDRL_ROLLOUT_MAX_N", default=64, type=click.IntRange(min=1),
            help="Largest sampling.n a request may ask for.")
@env_option("--max-tokens", env="GRIDRL_ROLLOUT_MAX_TOKENS", default=2048,
            type=click.IntRange(min=1), help="Largest sampling.max_tokens a request may ask for.")
@env_option("--max-adapter-bytes", env="GRIDRL_ROLLOUT_MAX_ADAPTER_BYTES", default=512 << 20,
            type=click.IntRange(min=1), help="Largest adapter push accepted, in bytes.")
@env_option("--keep-adapters", env="GRIDRL_ROLLOUT_KEEP_ADAPTERS", default=8,
            type=click.IntRange(min=0),
            help="Pushed versions kept on disk per adapter name, newest first (0: all).")
@env_option("--keep-runs", env="GRIDRL_ROLLOUT_KEEP_RUNS", default=4,
            type=click.IntRange(min=0),
            help="Adapter names (runs) kept on disk, by latest push (0: all); names other "
                 "than the one pushed keep only their newest version.")
@env_option("--adapter-root", env="GRIDRL_ROLLOUT_ADAPTER_ROOT", default=None,
            show_default=False, type=click.Path(file_okay=False),
            help="Directory of the node's adapters (pushed ones, and those ReloadAdapter may "
                 "load by path) [default: <gridrl cache>/rollout/<name>/adapters].")
@env_option("--master", env="GRIDRL_ROLLOUT_MASTER", default=None, show_default=False,
            help="host:port of the master to register with and heartbeat.")
@env_option("--advertise-address", env="GRIDRL_ROLLOUT_ADVERTISE_ADDRESS", default=None,
            show_default=False,
            help="host:port to register with the master [default: the bound address].")
@env_option("--name", env="GRIDRL_ROLLOUT_NAME", default=None, show_default=False,
            help="Node name for logs and the default adapter root [default: <hostname>-<port>].")
@env_option("--openai-listen", env="GRIDRL_ROLLOUT_OPENAI_LISTEN", default=None,
            show_default=False,
            help="host:port of an OpenAI-compatible HTTP endpoint (/v1/models, /v1/completions, "
                 "/v1/chat/completions; port 0: any free port) [default: off]. It shares the "
                 "engine queue and the bearer token with gRPC; needs gridrl-rollout[openai].")
def serve(listen: str, metrics_port: int, security: Security, log_level: str,
          ready_file: str | None, backend: str, model: str, vllm_url: str | None,
          vllm_api_key_file: str | None, device: str, dtype: str,
          forward: str, threads: int, capacity: int, max_queue: int, max_n: int, max_tokens: int, max_adapter_bytes: int,
          keep_adapters: int, keep_runs: int, adapter_root: str | None, master: str | None, advertise_address: str | None,
          name: str | None, openai_listen: str | None) -> None:
    """Serve RolloutService until SIGTERM/SIGINT."""
    setup_logging(log_level)
    from gridrl.common.address import parse_address, parse_listen
    from gridrl.common.errors import StatusError

    for flag, value, parse in (("--listen", listen, parse_listen), ("--master", master,
                               parse_address), ("--advertise-address", advertise_address,
                                                parse_address),
                               ("--openai-listen", openai_listen, parse_listen)):
        if value is not None:
            try:
                parse(value, flag)
            except StatusError as e:
                raise click.BadParameter(e.message.removeprefix(f"{flag}: "),
                                         param_hint=flag) from None
    from gridrl.models import ModelNameError, check_model

    try:  # a typo fails here, in milliseconds, not after hub retries
        check_model(model)
    except ModelNameError as e:
        raise click.BadParameter(str(e).removeprefix("--model: "), param_hint="--model") from None
    if master is not None:
        from gridrl.common.probe import REGISTRY, check_service

        try:  # another service there: say which, before the model loads
            check_service(master, REGISTRY, "--master", security)
        except StatusError as e:
            raise click.BadParameter(e.message.removeprefix("--master: "),
                                     param_hint="--master") from None
    if backend == "mlx" and dtype != "auto":
        raise click.BadParameter("the mlx backend computes in the stored dtype; use auto",
                                 param_hint="--dtype")
    if backend == "mlx" and device.startswith("cuda"):
        raise click.BadParameter("the mlx backend runs on cpu or the Apple GPU (mps)",
                                 param_hint="--device")
    vllm_api_key = _check_vllm_flags(backend, vllm_url, vllm_api_key_file, device, dtype)
    if openai_listen:
        try:
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise click.BadParameter(f"needs the openai extra ({e}): pip install "
                                     "'gridrl-rollout[openai]'",
                                     param_hint="--openai-listen") from e
        from gridrl.common.security import ExposedError, check_exposure

        try:  # the HTTP endpoint follows the gRPC side's rule: loopback, or TLS + credentials
            check_exposure(parse_listen(openai_listen, "--openai-listen")[0], security,
                           "--openai-listen")
        except ExposedError as e:
            raise click.UsageError(str(e)) from None
    from gridrl.common.server import freeze_long_lived
    from gridrl.models import resolve_model
    from gridrl.rollout import server as node_server
    from gridrl.rollout.server import NodeConfig, RolloutNode, run_on_engine_thread

    try:
        model_dir = resolve_model(model)
    except FileNotFoundError as e:
        raise click.BadParameter(str(e), param_hint="--model") from e
    config = NodeConfig(
        listen=listen, metrics_port=metrics_port, security=security, capacity=capacity,
        max_queue=max_queue, max_n=max_n, max_tokens=max_tokens,
        max_adapter_bytes=max_adapter_bytes, keep_adapters=keep_adapters, keep_runs=keep_runs,
        adapter_root=adapter_root,
        advertise_address=advertise_address, master=master, name=name,
        openai_listen=openai_listen)

    def load() -> RolloutNode:
        try:
            if backend == "torch":
                # Before torch loads OpenMP: idle workers spin ~10k iterations (tens of us)
                # before sleeping. Enough to catch the next parallel region of a decode step
                # (sleeping at once, OMP_WAIT_POLICY=PASSIVE, cost ~20% of fp32 decode speed
                # here), short enough not to steal a core from a trainer on the same machine.
                os.environ.setdefault("GOMP_SPINCOUNT", "10000")
                import torch

                from gridrl.engine.backends.torch import TorchBackend

                if threads:
                    torch.set_num_threads(threads)
                engine_backend = TorchBackend.from_pretrained(
                    model_dir, device=device, dtype=dtype, model_id=model,
                    lean=forward == "lean")
            elif backend == "vllm":
                from gridrl.engine.backends.vllm import VllmBackend, VllmError

                try:
                    engine_backend = VllmBackend.connect(
                        vllm_url, model_dir, node_server.adapter_root(config) / ".vllm",
                        api_key=vllm_api_key, model_id=model, max_concurrency=capacity)
                except VllmError as e:
                    raise click.ClickException(str(e)) from e
            else:
                from gridrl.engine.backends.mlx import MlxBackend

                engine_backend = MlxBackend.from_pretrained(
                    model_dir, device={"mps": "gpu"}.get(device, device))
                engine_backend.identity = dataclasses.replace(engine_backend.identity,
                                                              model_id=model)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--device/--dtype/--model") from e
        return RolloutNode(engine_backend, config)

    # The model is loaded on the thread that then runs the engine's scheduler: every torch
    # parallel region of the process starts from that one thread. An OpenMP thread team
    # left behind by another thread makes libgomp throttle its spin-waits, costing ~20% of
    # the decode speed on 2 cores (docs/benchmarks.md).
    node = run_on_engine_thread(load)
    freeze_long_lived()  # the model lives as long as the node
    try:
        node.start()
    except OSError as e:  # the port is taken (servers never share one)
        node.stop(grace_s=0)
        raise click.UsageError(str(e)) from None
    openai = {"openai_base_url": node.openai.base_url} if node.openai else {}
    write_ready_file(ready_file, node.address, node.port, node.metrics_port, **openai)
    node.wait()
    if node.engine.scheduler_alive:
        # The stop interrupted the batch in progress, but the scheduler thread is still inside
        # torch / MLX (a step slower than the engine's close timeout). Finalizing the
        # interpreter now would end that thread inside C++ code as it takes the GIL back:
        # std::terminate, exit 134. Everything else is stopped and flushed by now, so leave
        # without interpreter cleanup.
        import logging

        logging.getLogger(__name__).warning(
            "the engine's scheduler is still in the backend; exiting without cleanup")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _check_vllm_flags(backend: str, url: str | None, key_file: str | None, device: str,
                      dtype: str) -> str | None:
    """Check the --vllm-* flags against --backend; returns the API key read from its file."""
    if backend != "vllm":
        for flag, value in (("--vllm-url", url), ("--vllm-api-key-file", key_file)):
            if value is not None:
                raise click.BadParameter("only with --backend vllm", param_hint=flag)
        return None
    from urllib.parse import urlsplit

    if url is None:
        raise click.BadParameter("required with --backend vllm", param_hint="--vllm-url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("",
                                                                                         "/"):
        raise click.BadParameter(f"{url!r} is not a base URL like http://127.0.0.1:8000",
                                 param_hint="--vllm-url")
    for flag, value in (("--device", device), ("--dtype", dtype)):
        if value != "auto":
            raise click.BadParameter("vLLM chooses its own; set it on vLLM", param_hint=flag)
    if key_file is None:
        return None
    from pathlib import Path

    key = Path(key_file).read_text().strip()
    if not key:
        raise click.BadParameter(f"{key_file} is empty", param_hint="--vllm-api-key-file")
    return key


def _parse_ids(value: str | None, flag: str) -> list[int]:
    if not value:
        return []
    try:
        return [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError as e:
        raise click.BadParameter(f"{value!r} is not comma-separated integers",
                                 param_hint=flag) from e


@main.command()
@_address_option("sample from")
@client_security_options
@env_option("--prompt", env="GRIDRL_ROLLOUT_GENERATE_PROMPT", default=None, show_default=False,
            help="Prompt text (tokenized by the node).")
@env_option("--prompt-ids", env="GRIDRL_ROLLOUT_GENERATE_PROMPT_IDS", default=None,
            show_default=False, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@env_option("--n", env="GRIDRL_ROLLOUT_GENERATE_N", default=1, type=click.IntRange(min=1),
            help="Number of samples.")
@env_option("--max-tokens", env="GRIDRL_ROLLOUT_GENERATE_MAX_TOKENS", default=64,
            type=click.IntRange(min=1), help="Most new tokens per sample.")
@env_option("--temperature", env="GRIDRL_ROLLOUT_GENERATE_TEMPERATURE", default=1.0,
            type=float, help="Softmax temperature (0: greedy).")
@env_option("--top-k", env="GRIDRL_ROLLOUT_GENERATE_TOP_K", default=0, type=int,
            help="Keep the k most likely tokens (0: off).")
@env_option("--top-p", env="GRIDRL_ROLLOUT_GENERATE_TOP_P", default=1.0, type=float,
            help="Nucleus mass in (0, 1] (1: off).")
@env_option("--seed", env="GRIDRL_ROLLOUT_GENERATE_SEED", default=None, type=int,
            show_default=False, help="Sampler seed (same seed, same samples) [default: random].")
@env_option("--stop-ids", env="GRIDRL_ROLLOUT_GENERATE_STOP_IDS", default=None,
            show_default=False, help="Comma-separated token ids that end a sample (besides eos).")
@env_option("--chat/--no-chat", env="GRIDRL_ROLLOUT_GENERATE_CHAT", default=True,
            help="Wrap --prompt as a user message in the model's chat template.")
@env_option("--system", env="GRIDRL_ROLLOUT_GENERATE_SYSTEM", default=None, show_default=False,
            help="System message before --prompt in the chat template (a task's own, e.g. "
                 "reverse-words', to reproduce its prompts) [default: none].")
@_json_option("GENERATE")
@_timeout_option("GENERATE", 300.0)
@exit_on_rpc_error
def generate(address: str, security: Security, prompt: str | None, prompt_ids: str | None,
             n: int, max_tokens: int, temperature: float, top_k: int, top_p: float,
             seed: int | None, stop_ids: str | None, chat: bool, system: str | None,
             as_json: bool, timeout: float) -> None:
    """Sample completions of one prompt and print them with their behaviour logprobs, and
    the adapter (name and policy version) that produced them."""
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    if system is not None and (prompt is None or not chat):
        raise click.BadParameter("needs --prompt with --chat (the system message is a turn "
                                 "of the chat template)", param_hint="--system")
    from gridrl.common.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    sampling = common_pb2.SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, stop_token_ids=_parse_ids(stop_ids,
                                                                                "--stop-ids"))
    if top_p != 1.0:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    request = rollout_pb2.GenerateRequest(sampling=sampling)
    if prompt is not None:
        request.prompt_text = prompt
        request.apply_chat_template = chat
        request.system_prompt = system or ""
    else:
        request.prompt_token_ids.extend(_parse_ids(prompt_ids, "--prompt-ids"))
    channel = dial(address, security)
    try:
        response = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(request, timeout=timeout)
    finally:
        channel.close()
    if as_json:
        print_json(response)
        return
    for i, s in enumerate(response.samples):
        mean = sum(s.logprobs) / len(s.logprobs) if s.logprobs else 0.0
        adapter = (f"adapter {s.adapter_name} v{s.adapter_version}" if s.adapter_name
                   else "the base model")
        click.echo(f"--- sample {i} ({len(s.token_ids)} tokens, {_FINISH.get(s.finish_reason, '?')}"
                   f", mean logprob {mean:.3f}, {adapter})")
        click.echo(s.text)
    click.echo(f"({len(response.prompt_token_ids)} prompt tokens, {response.duration_s:.2f}s)")


@main.command("push-adapter")
@_address_option("push to")
@client_security_options
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@env_option("--name", env="GRIDRL_ROLLOUT_PUSH_NAME", default=None, show_default=False,
            help="Adapter name [default: the directory's name].")
@env_option("--version", "version", env="GRIDRL_ROLLOUT_PUSH_VERSION", default=None,
            type=click.IntRange(min=1), show_default=False,
            help="Policy version [default: one more than the node's newest of that name].")
@env_option("--stage-only", env="GRIDRL_ROLLOUT_PUSH_STAGE_ONLY", is_flag=True, default=False,
            help="Store and verify on the node but keep serving the current adapter.")
@_json_option("PUSH")
@_timeout_option("PUSH", 120.0)
@exit_on_rpc_error
def push_adapter(address: str, security: Security, directory: str, name: str | None,
                 version: int | None, stage_only: bool, as_json: bool, timeout: float) -> None:
    """Stream the peft or mlx-lm adapter in DIRECTORY to a node (PushAdapter)."""
    from pathlib import Path

    from gridrl.adapters import AdapterError, build_manifest, read_dir
    from gridrl.common.channel import dial
    from gridrl.common.transport import push_requests
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    name = name or re.sub(r"[^A-Za-z0-9._-]", "-", Path(directory).resolve().name).lstrip(".")
    channel = dial(address, security)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        if version is None:
            info = stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=timeout).info
            version = 1 + max((a.version for a in info.stored_adapters if a.name == name),
                              default=0)
        try:
            files = read_dir(directory)
            manifest = build_manifest(files, name=name, version=version)
        except AdapterError as e:
            raise click.BadParameter(str(e), param_hint="DIRECTORY") from e
        response = stub.PushAdapter(push_requests(manifest.to_dict(), files,
                                                  stage_only=stage_only), timeout=timeout)
    finally:
        channel.close()
    if as_json:
        print_json(response)
        return
    t = response.timings
    click.echo(f"pushed {name} v{version} ({response.bytes_received} bytes"
               f"{', converted' if response.converted else ''}); serving "
               f"{_ref_text(response.serving)}; receive {t.receive_s:.3f}s verify "
               f"{t.verify_s:.3f}s convert {t.convert_s:.3f}s apply {t.apply_s:.3f}s")


@main.command("reload-adapter")
@_address_option("switch")
@client_security_options
@env_option("--version", "version", env="GRIDRL_ROLLOUT_RELOAD_VERSION", default=None,
            type=click.IntRange(min=1), show_default=False, help="A version pushed earlier.")
@env_option("--path", env="GRIDRL_ROLLOUT_RELOAD_PATH", default=None, show_default=False,
            help="A directory relative to the node's --adapter-root.")
@env_option("--base", env="GRIDRL_ROLLOUT_RELOAD_BASE", is_flag=True, default=False,
            help="Serve the base model with no adapter.")
@_json_option("RELOAD")
@_timeout_option("RELOAD", 120.0)
@exit_on_rpc_error
def reload_adapter(address: str, security: Security, version: int | None, path: str | None,
                   base: bool, as_json: bool, timeout: float) -> None:
    """Switch a node to an adapter it already has, or to the base model (ReloadAdapter)."""
    if sum((version is not None, path is not None, base)) != 1:
        raise click.UsageError("give exactly one of --version, --path and --base")
    from gridrl.common.channel import dial
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    if version is not None:
        request = rollout_pb2.ReloadAdapterRequest(version=version)
    elif path is not None:
        request = rollout_pb2.ReloadAdapterRequest(path=path)
    else:
        request = rollout_pb2.ReloadAdapterRequest(base_model=True)
    channel = dial(address, security)
    try:
        response = rollout_pb2_grpc.RolloutServiceStub(channel).ReloadAdapter(request,
                                                                              timeout=timeout)
    finally:
        channel.close()
    if as_json:
        print_json(response)
        return
    click.echo(f"serving {_ref_text(response.serving)} (apply {response.apply_s:.3f}s)")


@main.command()
@_address_option("describe")
@client_security_options
@_json_option("INFO")
@_timeout_option("INFO", 10.0)
@exit_on_rpc_error
def info(address: str, security: Security, as_json: bool, timeout: float) -> None:
    """Print what a node serves: model, backend, adapter, bounds, queue depth, uptime."""
    from gridrl.common.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    channel = dial(address, security)
    try:
        response = rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
            rollout_pb2.GetNodeInfoRequest(), timeout=timeout)
    finally:
        channel.close()
    if as_json:
        print_json(response)
        return
    i = response.info
    rows = [
        ("address", i.address),
        ("backend", common_pb2.Backend.Name(i.backend).removeprefix("BACKEND_").lower()),
        ("model", i.base_model.model_id),
        ("architecture", f"{i.base_model.architecture}, {i.base_model.num_layers} layers, hidden "
                         f"{i.base_model.hidden_size}, vocab {i.base_model.vocab_size}"),
        ("weights", i.base_model.weights_fingerprint or "-"),
        ("device", f"{i.device} ({i.dtype})"),
        ("adapter format", common_pb2.AdapterFormat.Name(i.adapter_format)
         .removeprefix("ADAPTER_FORMAT_").lower()),
        ("adapter", _ref_text(i.adapter)),
        ("stored adapters", ", ".join(f"{a.name} v{a.version}" for a in i.stored_adapters) or "-"),
        ("capacity", f"{i.capacity} sequences per batch"),
        ("bounds", f"n <= {i.max_n}, max_tokens <= {i.max_tokens}, context {i.max_context}"),
        ("queue depth", str(i.queue_depth)),
        ("uptime", f"{i.uptime_s:.0f}s"),
        ("version", i.software_version),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key.ljust(width)}  {value}")


@main.command()
@env_option("--prune", env="GRIDRL_ROLLOUT_CACHE_PRUNE", is_flag=True, default=False,
            help="Remove the directories of port-0 nodes whose process is gone.")
def cache(prune: bool) -> None:
    """List the nodes' directories under <gridrl cache>/rollout (adapters pushed to them),
    with their size; --prune removes those no node will use again. A node on a fixed port
    or with --name keeps its directory for its next start; a port-0 node removes its own
    when it stops, so only killed ones leave theirs."""
    from gridrl.rollout import cache as node_cache

    entries = node_cache.scan()
    removed = {e.path for e in node_cache.prune(entries)} if prune else set()
    click.echo(f"{node_cache.rollout_cache()}: {len(entries)} node director"
               f"{'y' if len(entries) == 1 else 'ies'}")
    for e in entries:
        state = ("named: kept for the node's next start" if e.pid is None
                 else f"port-0 node, process {e.pid} running" if e.running
                 else "removed" if e.path in removed
                 else f"port-0 node, process {e.pid} gone: --prune removes it")
        click.echo(f"  {e.path.name:<32} {e.size_bytes / 1e6:8.1f} MB  {state}")
    if removed:
        freed = sum(e.size_bytes for e in entries if e.path in removed)
        click.echo(f"pruned {len(removed)} director{'y' if len(removed) == 1 else 'ies'}, "
                   f"{freed / 1e6:.1f} MB")


def _ref_text(ref) -> str:
    return f"{ref.name} v{ref.version}" if ref.name or ref.version else "the base model"


if __name__ == "__main__":
    sys.exit(main())
