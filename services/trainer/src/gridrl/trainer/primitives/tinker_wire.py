"""Tinker's wire format (SDK ``tinker`` 0.38) to and from the primitives' domain types.

The SDK sends ``forward_backward`` as a protobuf ``tinker_public.ForwardBackwardRequest``
(optionally zstd-compressed) and reads ``ForwardBackwardOutput`` and ``SampleResponse`` results
only as protobuf; everything else is JSON shaped by its pydantic types. Both are the SDK's own
definitions (``tinker.proto.tinker_public_pb2``, ``tinker.types``), imported from the installed
SDK (the ``tinker`` extra of gridrl-trainer), so the facade cannot drift from the client it
serves. Pure functions; errors are INVALID_ARGUMENT :class:`StatusError` s naming the field in
the SDK's terms (``data[3].loss_fn_inputs['advantages']``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from gridrl.common.errors import invalid_argument
from gridrl.trainer.primitives.types import (
    DEFAULT_CLIP_HIGH,
    DEFAULT_CLIP_LOW,
    DEFAULT_DRO_BETA,
    LOSS_FUNCTIONS,
    LOSS_SETTINGS,
    AdamSettings,
    Datum,
    ForwardResult,
    LossSpec,
    SampleResult,
    SamplingSpec,
)

PROTOBUF = "application/x-protobuf"
TOPK_MASK_LOGPROB = -99999.0  # tinker.types.topk_logprobs.MASK_LOGPROB: a row not scored
DEFAULT_MAX_TOKENS = 256  # SamplingParams.max_tokens left unset
# loss_fn_inputs key -> Datum field
_INPUTS = {"target_tokens": "target_ids", "weights": "weights", "advantages": "advantages",
           "logprobs": "sampling_logprobs"}
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def parse(model: type[Any], body: Any, what: str) -> Any:
    """``model.model_validate(body)`` (an SDK request type); INVALID_ARGUMENT naming the
    first field pydantic refused."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or what
        raise invalid_argument(f"{what}.{where}", first["msg"]) from None


# ------------------------------------------------------------------------- forward_backward

@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``/api/v1/forward_backward`` body."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss: LossSpec
    forward_only: bool


def forward_backward_message(body: bytes, content_encoding: str | None
                             ) -> pb.ForwardBackwardRequest:
    """The protobuf ``ForwardBackwardRequest`` of a body (zstd when ``Content-Encoding:
    zstd``), not yet checked: its ``model_id`` and ``seq_id`` are known even when the rest is
    refused by :func:`forward_backward_call`."""
    if content_encoding and content_encoding.lower() == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise invalid_argument("body", f"not a tinker_public.ForwardBackwardRequest: {e}") from e
    return msg


def forward_backward_call(msg: pb.ForwardBackwardRequest) -> ForwardBackwardCall:
    """The checked call of a ``ForwardBackwardRequest``; INVALID_ARGUMENT naming the field."""
    return ForwardBackwardCall(model_id=msg.model_id, seq_id=msg.seq_id,
                               data=[_datum(d, i) for i, d in enumerate(msg.data)],
                               loss=_loss(msg), forward_only=msg.forward_only)


def _loss(msg: pb.ForwardBackwardRequest) -> LossSpec:
    if msg.loss_fn not in LOSS_FUNCTIONS:
        raise invalid_argument("loss_fn", f"{msg.loss_fn!r} is not supported by gridrl (it "
                               f"implements {', '.join(LOSS_FUNCTIONS)}; "
                               "forward_backward_custom works, it runs on cross_entropy)")
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise invalid_argument(f"loss_fn_config['{key}']", "text values are not supported")
        config[key] = value.number
    known = LOSS_SETTINGS[msg.loss_fn]
    for key in config:
        if key not in known:
            reads = ", ".join(known) if known else "no settings"
            raise invalid_argument(f"loss_fn_config['{key}']",
                                   f"not a setting of {msg.loss_fn} (it reads {reads})")
    return LossSpec(msg.loss_fn, config.get("clip_low_threshold", DEFAULT_CLIP_LOW),
                    config.get("clip_high_threshold", DEFAULT_CLIP_HIGH),
                    config.get("beta", DEFAULT_DRO_BETA))


def _datum(d: pb.Datum, i: int) -> Datum:
    tokens: list[np.ndarray] = []
    for c in d.model_input:
        kind = c.WhichOneof("chunk")
        if kind != "encoded_text":
            raise invalid_argument(f"data[{i}].model_input", f"{kind} chunks are not supported "
                                   "(gridrl trains text models: encoded_text only)")
        tokens.append(np.frombuffer(c.encoded_text.tokens, dtype=np.int32))
    ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    fields: dict[str, np.ndarray] = {}
    for key, tensor in d.loss_fn_inputs.items():
        name = f"data[{i}].loss_fn_inputs['{key}']"
        if key not in _INPUTS:
            raise invalid_argument(name, f"not an input gridrl's losses read (they read "
                                   f"{', '.join(_INPUTS)})")
        values = tensor_array(tensor, name)
        if values.ndim != 1:
            raise invalid_argument(name, f"shape {list(values.shape)}: only (N,) inputs are "
                                   "supported (no top-k targets)")
        fields[_INPUTS[key]] = values
    if "target_ids" not in fields:
        raise invalid_argument(f"data[{i}].loss_fn_inputs['target_tokens']", "is missing")
    return Datum(ids, fields.pop("target_ids").astype(np.int64),
                 **{k: v.astype(np.float32) for k, v in fields.items()})


def tensor_array(t: pb.Tensor, name: str) -> np.ndarray:
    """A ``tinker_public.Tensor`` as a dense numpy array (CSR: unlisted entries 0)."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise invalid_argument(name, f"dtype {pb.DType.Name(t.dtype)} is not supported")
    shape = list(t.shape)
    if t.HasField("sparse_csr"):
        values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise invalid_argument(name, "malformed sparse CSR tensor")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    values = np.frombuffer(t.dense, dtype=dtype)
    if shape:
        if int(np.prod(shape)) != values.size:
            raise invalid_argument(name, f"{values.size} values for shape {shape}")
        values = values.reshape(shape)
    return values


def forward_output(result: ForwardResult) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: per datum ``logprobs`` (float32, one per
    position) in one ``ArrayRecord``, and the metric ``loss:sum``."""
    lengths = [lp.shape[0] for lp in result.logprobs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) * 4
    data = (np.concatenate(result.logprobs) if result.logprobs else np.zeros(0)).astype(np.float32)
    record = pb.ArrayRecord(type_tag="logprobs", num_datums=len(lengths))
    record.fields["logprobs"].CopyFrom(pb.BatchedTensor(
        data=data.tobytes(), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics["loss:sum"] = result.loss
    return out.SerializeToString()


# ----------------------------------------------------------------------------- optimizer

def adam_settings(request: Any) -> AdamSettings:
    """The :class:`AdamSettings` of an ``OptimStepRequest`` (Adam only)."""
    p = request.optim_params
    if not isinstance(p, tt.AdamParams):
        raise invalid_argument("optim_params", f"{getattr(p, 'type', type(p).__name__)} is not "
                               "supported (gridrl steps AdamW only)")
    adam = AdamSettings(lr=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                        weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm)
    adam.check("adam_params")
    return adam


# ------------------------------------------------------------------------------ sampling

def sampling_spec(request: Any) -> tuple[list[int], SamplingSpec]:
    """The prompt and :class:`SamplingSpec` of a ``SampleRequest``; INVALID_ARGUMENT naming a
    feature gridrl does not serve (top-k logprobs of sampled tokens, target or alternative
    prompt tokens, stability records)."""
    unsupported = (("topk_sample_logprobs", request.topk_sample_logprobs),
                   ("target_prompt_logprobs", request.target_prompt_logprobs is not None),
                   ("prompt_alt_tokens_k", request.prompt_alt_tokens_k),
                   ("record_stability_info", request.record_stability_info))
    for name, value in unsupported:
        if value:
            raise invalid_argument(name, "is not supported by gridrl's sampler")
    try:
        prompt = request.prompt.to_ints()
    except ValueError as e:
        raise invalid_argument("prompt", "only encoded_text chunks are supported") from e
    p = request.sampling_params
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    if isinstance(p.stop, str):
        stop_strings = (p.stop,)
    elif p.stop is not None:
        stop = list(p.stop)
        if not stop:
            raise invalid_argument("sampling_params.stop", "[] (no stop, not even eos) is not "
                                   "supported: the nodes always stop at eos")
        if all(isinstance(s, int) for s in stop):
            stop_ids = tuple(int(s) for s in stop)
        elif all(isinstance(s, str) for s in stop):
            stop_strings = tuple(stop)
        else:
            raise invalid_argument("sampling_params.stop", "mixes token ids and strings")
    spec = SamplingSpec(n=request.num_samples,
                        max_tokens=p.max_tokens if p.max_tokens is not None else DEFAULT_MAX_TOKENS,
                        temperature=float(p.temperature), top_p=float(p.top_p),
                        top_k=max(int(p.top_k), 0), seed=p.seed, stop_token_ids=stop_ids,
                        stop_strings=stop_strings)
    spec.check()
    return prompt, spec


def sample_output(result: SampleResult, prompt_length: int, last_n: int | None) -> bytes:
    """A protobuf ``SampleResponse``: tokens (int32), processed logprobs (float32), stop
    reasons; prompt logprobs (NaN where not scored) when they were computed."""
    out = pb.SampleResponse()
    for s in result.sequences:
        out.sequences.add(stop_reason=_STOP[s.finish_reason],
                          tokens=np.asarray(s.token_ids, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
    if result.prompt_logprobs is not None:
        values = np.array([np.nan if v is None else v for v in result.prompt_logprobs],
                          dtype=np.float32)
        if last_n is not None:
            values[:max(prompt_length - last_n, 0)] = np.nan
        out.prompt_logprobs = values.tobytes()
    if result.topk_prompt is not None:
        ids, logprobs = result.topk_prompt
        k = ids.shape[1]
        # position 0 (and positions before the last ``last_n``) carry the SDK's sentinel
        all_ids = np.zeros((prompt_length, k), dtype=np.int32)
        all_lps = np.full((prompt_length, k), TOPK_MASK_LOGPROB, dtype=np.float32)
        all_ids[1:], all_lps[1:] = ids, logprobs
        if last_n is not None:
            cut = max(prompt_length - last_n, 0)
            all_ids[:cut], all_lps[:cut] = 0, TOPK_MASK_LOGPROB
        out.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
            token_ids=all_ids.tobytes(), logprobs=all_lps.tobytes(), k=k, length=prompt_length))
    return out.SerializeToString()
