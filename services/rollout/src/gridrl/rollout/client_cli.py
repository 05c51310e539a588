"""``gridrl-rollout``'s client commands: sample from a node, push or switch its adapter,
describe it, and list the nodes' directories on this machine.

Every command takes ``--address`` and the client security flags
(:func:`gridrl.common.cli.client_security_options`); imports stay light (click, grpc,
protobuf).
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from gridrl.common.cli import (
    address_option,
    client_security_options,
    env_option,
    exit_on_rpc_error,
    print_json,
    renamed_option,
)
from gridrl.common.rpc.channel import dial
from gridrl.common.security.policy import Security
from gridrl.common.transport import push_requests
from gridrl.rollout import cache as node_cache
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from gridrl.v1.enums import enum_word


def _address_option(command: str):
    return address_option("--address", env="GRIDRL_ROLLOUT_ADDRESS", default="127.0.0.1:50051",
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


def _parse_ids(value: str | None, flag: str) -> list[int]:
    if not value:
        return []
    try:
        return [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError as e:
        raise click.BadParameter(f"{value!r} is not comma-separated integers",
                                 param_hint=flag) from e


@click.command()
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
        click.echo(f"--- sample {i} ({len(s.token_ids)} tokens, {_finish(s.finish_reason)}"
                   f", mean logprob {mean:.3f}, {adapter})")
        click.echo(s.text)
    click.echo(f"({len(response.prompt_token_ids)} prompt tokens, {response.duration_s:.2f}s)")


@click.command("push-adapter")
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
    from gridrl.adapters import AdapterError, build_manifest, read_dir

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
        response = stub.PushAdapter(push_requests(manifest, files,
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


@click.command("reload-adapter")
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


@click.command()
@_address_option("describe")
@client_security_options
@_json_option("INFO")
@_timeout_option("INFO", 10.0)
@exit_on_rpc_error
def info(address: str, security: Security, as_json: bool, timeout: float) -> None:
    """Print what a node serves: model, backend, adapter, bounds, queue depth, uptime."""

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
        ("backend", enum_word(common_pb2.Backend, i.backend, None)),
        ("model", i.base_model.model_id),
        ("architecture", f"{i.base_model.architecture}, {i.base_model.num_layers} layers, hidden "
                         f"{i.base_model.hidden_size}, vocab {i.base_model.vocab_size}"),
        ("weights", i.base_model.weights_fingerprint or "-"),
        ("device", f"{i.device} ({i.dtype})"),
        ("adapter format", enum_word(common_pb2.AdapterFormat, i.adapter_format, None)),
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


@click.command()
@env_option("--prune", env="GRIDRL_ROLLOUT_CACHE_PRUNE", is_flag=True, default=False,
            help="Remove the directories of port-0 nodes whose process is gone.")
def cache(prune: bool) -> None:
    """List the nodes' directories under <gridrl cache>/rollout (adapters pushed to them),
    with their size; --prune removes those no node will use again. A node on a fixed port
    or with --name keeps its directory for its next start; a port-0 node removes its own
    when it stops, so only killed ones leave theirs."""
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


def _finish(reason: int) -> str:
    """``FINISH_REASON_STOP`` -> ``"stop"`` (``"?"`` for a value this client does not know)."""
    if reason not in common_pb2.FinishReason.values():
        return "?"
    return enum_word(common_pb2.FinishReason, reason, None)


COMMANDS = (generate, push_adapter, reload_adapter, info, cache)
