"""``TrainingService`` over gRPC (protos/gridrl/v1/primitives.proto): the wire of the
primitives for gridrl's own clients. Each RPC converts its request to the domain types
(:mod:`gridrl.trainer.primitives.types`), waits for :class:`PrimitivesService`'s future and
converts the answer; :class:`gridrl.common.errors.StatusError` s become the call's status (the
server's interceptor).
"""

from __future__ import annotations

from concurrent import futures
from typing import Any, TypeVar

import grpc

from gridrl.common.errors import invalid_argument
from gridrl.trainer.primitives import paths
from gridrl.trainer.primitives.fleet import adapter_name
from gridrl.trainer.primitives.service import PrimitivesService, SampleTarget
from gridrl.trainer.primitives.types import (
    DEFAULT_CLIP_HIGH,
    DEFAULT_CLIP_LOW,
    DEFAULT_DRO_BETA,
    AdamSettings,
    Datum,
    LoraRequest,
    LossSpec,
    ModelInfo,
    SamplingSpec,
)
from gridrl.v1 import common_pb2, primitives_pb2, primitives_pb2_grpc

SERVICE_NAME = primitives_pb2.DESCRIPTOR.services_by_name["TrainingService"].full_name
T = TypeVar("T")
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}


def _wait(future: futures.Future[T], context: grpc.ServicerContext) -> T:
    """The future's result; its StatusError is the call's status. A cancelled call does not
    cancel the work (it is queued on the model thread in order)."""
    left = context.time_remaining()  # huge (not None) for a call without a deadline
    return future.result(timeout=left if left is not None and left < 1e6 else None)


def loss_spec(function: int, config: primitives_pb2.LossConfig) -> LossSpec:
    """The domain loss of a ``LossFunction`` value and its config.

    Raises:
        StatusError: INVALID_ARGUMENT ``loss_function`` for UNSPECIFIED or an unknown value.
    """
    if function == primitives_pb2.LOSS_FUNCTION_UNSPECIFIED:
        raise invalid_argument("loss_function", "is unspecified")
    try:
        name = primitives_pb2.LossFunction.Name(function).removeprefix("LOSS_FUNCTION_").lower()
    except ValueError as e:
        raise invalid_argument("loss_function", f"unknown value {function}") from e
    return LossSpec(name, config.clip_low_threshold if config.HasField("clip_low_threshold")
                    else DEFAULT_CLIP_LOW,
                    config.clip_high_threshold if config.HasField("clip_high_threshold")
                    else DEFAULT_CLIP_HIGH,
                    config.beta if config.HasField("beta") else DEFAULT_DRO_BETA)


def datums(data: Any) -> list[Datum]:
    """Domain datums of repeated ``Datum`` messages (empty lists read as absent)."""
    return [Datum.of(d.input_token_ids, d.target_token_ids, weights=d.weights,
                     advantages=d.advantages, sampling_logprobs=d.sampling_logprobs)
            for d in data]


def session_info(info: ModelInfo) -> primitives_pb2.TrainingSessionInfo:
    """The proto of a :class:`ModelInfo`."""
    return primitives_pb2.TrainingSessionInfo(
        session_id=info.model_id,
        base_model=common_pb2.BaseModel(model_id=info.base_model,
                                        architecture=info.architecture),
        lora_rank=info.lora_rank, lora_alpha=info.lora_alpha,
        target_modules=info.target_modules, optimizer_steps=info.steps,
        policy_version=info.policy_version, pending_datums=info.pending_datums)


class TrainingServicer(primitives_pb2_grpc.TrainingServiceServicer):
    """gRPC face of a :class:`PrimitivesService`."""

    def __init__(self, service: PrimitivesService) -> None:
        self.service = service

    def CreateTrainingSession(self, request: primitives_pb2.CreateTrainingSessionRequest,
                              context: grpc.ServicerContext
                              ) -> primitives_pb2.CreateTrainingSessionResponse:
        """A base model with a fresh LoRA (or a saved state's)."""
        if not request.base_model:
            raise invalid_argument("base_model", "is empty")
        lora = request.lora
        both = not (lora.train_attn or lora.train_mlp)  # neither set: the proto's default
        state = (paths.parse(request.state_path, "state_path", kind=paths.STATE)
                 if request.state_path else None)
        info = _wait(self.service.create_model(
            request.base_model,
            LoraRequest(rank=lora.rank, seed=lora.seed if lora.HasField("seed") else None,
                        train_attn=lora.train_attn or both, train_mlp=lora.train_mlp or both)
            if state is None else LoraRequest(),
            state=state, with_optimizer=request.with_optimizer), context)
        return primitives_pb2.CreateTrainingSessionResponse(session_id=info.model_id,
                                                            info=session_info(info))

    def GetTrainingSession(self, request: primitives_pb2.GetTrainingSessionRequest,
                           context: grpc.ServicerContext
                           ) -> primitives_pb2.GetTrainingSessionResponse:
        """What a session is."""
        return primitives_pb2.GetTrainingSessionResponse(
            info=session_info(self.service.info(request.session_id)))

    def CloseTrainingSession(self, request: primitives_pb2.CloseTrainingSessionRequest,
                             context: grpc.ServicerContext
                             ) -> primitives_pb2.CloseTrainingSessionResponse:
        """Release a session."""
        self.service.info(request.session_id)  # NOT_FOUND for an unknown one
        _wait(self.service.close_model(request.session_id), context)
        return primitives_pb2.CloseTrainingSessionResponse()

    def Forward(self, request: primitives_pb2.ForwardRequest,
                context: grpc.ServicerContext) -> primitives_pb2.ForwardResponse:
        """Scores, no gradient."""
        outputs, loss = self._forward(request, context, backward=False)
        return primitives_pb2.ForwardResponse(outputs=outputs, loss=loss)

    def ForwardBackward(self, request: primitives_pb2.ForwardBackwardRequest,
                        context: grpc.ServicerContext) -> primitives_pb2.ForwardBackwardResponse:
        """Scores, and the loss's gradient accumulated."""
        outputs, loss = self._forward(request, context, backward=True)
        return primitives_pb2.ForwardBackwardResponse(outputs=outputs, loss=loss)

    def _forward(self, request: Any, context: grpc.ServicerContext, *, backward: bool
                 ) -> tuple[list[primitives_pb2.DatumOutput], float]:
        result = _wait(self.service.forward(
            request.session_id, datums(request.data),
            loss_spec(request.loss_function, request.loss_config), backward=backward), context)
        return [primitives_pb2.DatumOutput(logprobs=lp.tolist()) for lp in result.logprobs], \
            result.loss

    def OptimStep(self, request: primitives_pb2.OptimStepRequest,
                  context: grpc.ServicerContext) -> primitives_pb2.OptimStepResponse:
        """One AdamW step."""
        a = request.adam
        adam = AdamSettings(lr=a.learning_rate, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                            weight_decay=a.weight_decay, grad_clip_norm=a.grad_clip_norm)
        adam.check("adam")
        result = _wait(self.service.optim_step(request.session_id, adam), context)
        return primitives_pb2.OptimStepResponse(grad_norm=result.grad_norm,
                                                optimizer_steps=result.steps,
                                                datums=result.datums)

    def SaveState(self, request: primitives_pb2.SaveStateRequest,
                  context: grpc.ServicerContext) -> primitives_pb2.SaveStateResponse:
        """Adapter and optimizer to disk."""
        uri = _wait(self.service.save_state(request.session_id,
                                            paths.check_name(request.name, "name")), context)
        where = paths.parse(uri)
        return primitives_pb2.SaveStateResponse(path=uri,
                                                directory=str(where.directory(self.service.root)))

    def LoadState(self, request: primitives_pb2.LoadStateRequest,
                  context: grpc.ServicerContext) -> primitives_pb2.LoadStateResponse:
        """A saved state back into a session."""
        where = paths.parse(request.path, "path", kind=paths.STATE)
        _wait(self.service.load_state(request.session_id, where,
                                      with_optimizer=request.with_optimizer), context)
        return primitives_pb2.LoadStateResponse()

    def SaveWeightsForSampler(self, request: primitives_pb2.SaveWeightsForSamplerRequest,
                              context: grpc.ServicerContext
                              ) -> primitives_pb2.SaveWeightsForSamplerResponse:
        """A new policy version, on disk and on the nodes."""
        snap = _wait(self.service.save_for_sampler(request.session_id, request.name or None),
                     context)
        return primitives_pb2.SaveWeightsForSamplerResponse(
            policy_version=snap.version, path=snap.uri, peft_directory=str(snap.peft_dir),
            mlx_directory=str(snap.mlx_dir or ""), nodes_synced=snap.nodes_synced)

    def Sample(self, request: primitives_pb2.SampleRequest,
               context: grpc.ServicerContext) -> primitives_pb2.SampleResponse:
        """Samples of one prompt on a policy version."""
        if request.session_id:
            target = self.service.base_target(request.session_id, request.policy_version)
        elif request.base_model:
            target = SampleTarget(request.base_model)
        else:
            raise invalid_argument("session_id", "give a session (or a base_model)")
        s = request.sampling
        spec = SamplingSpec(n=s.n or 1, max_tokens=s.max_tokens, temperature=s.temperature,
                            top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k,
                            seed=s.seed if s.HasField("seed") else None,
                            stop_token_ids=tuple(s.stop_token_ids),
                            stop_strings=tuple(request.stop_strings))
        spec.check("sampling")
        result = _wait(self.service.sample(target, request.prompt_token_ids, spec), context)
        tokenizer = self.service.tokenizer(target.base_model)
        name = adapter_name(target.model_id) if target.model_id else ""
        return primitives_pb2.SampleResponse(sampled_by=result.sampled_by, samples=[
            common_pb2.Sample(token_ids=q.token_ids, logprobs=q.logprobs,
                              text=tokenizer.decode(q.token_ids, skip_special_tokens=True),
                              finish_reason=_FINISH[q.finish_reason],
                              adapter_version=q.policy_version,
                              adapter_name=name if q.policy_version else "")
            for q in result.sequences])


def add_to(server: Any, service: PrimitivesService) -> TrainingServicer:
    """Register ``TrainingService`` on a :class:`gridrl.common.rpc.server.GrpcServer`."""
    servicer = TrainingServicer(service)
    server.add(primitives_pb2_grpc.add_TrainingServiceServicer_to_server, servicer, SERVICE_NAME)
    return servicer

