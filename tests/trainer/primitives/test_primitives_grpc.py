"""TrainingService through a real gRPC server and channel, on the tiny llama: the primitives'
round trip and errors, and samples routed to a rollout node serving the version asked for
(the trainer samples the versions no node serves, with the same seeds: the same samples)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gridrl.common.rpc.channel import dial
from gridrl.common.rpc.server import GrpcServer
from gridrl.trainer.primitives import grpc_servicer
from gridrl.trainer.primitives.serve import torch_loader
from gridrl.trainer.primitives.service import PrimitivesService
from gridrl.v1 import common_pb2, primitives_pb2, primitives_pb2_grpc, rollout_pb2, rollout_pb2_grpc

pb = primitives_pb2
CE = pb.LOSS_FUNCTION_CROSS_ENTROPY
DATA = [pb.Datum(input_token_ids=[5, 9, 12, 7], target_token_ids=[9, 12, 7, 2],
                 weights=[0, 1, 1, 1]),
        pb.Datum(input_token_ids=[3, 4, 8], target_token_ids=[4, 8, 2])]
ADAM = pb.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def serve(service: PrimitivesService) -> GrpcServer:
    server = GrpcServer("127.0.0.1:0", grace_s=1)
    grpc_servicer.add_to(server, service)
    return server.start()


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[primitives_pb2_grpc.TrainingServiceStub]:
    service = PrimitivesService(root=tmp_path / "api", load_model=torch_loader("cpu", "auto"),
                                lora_alpha=8)
    server = serve(service)
    with dial(server.address) as channel:
        yield primitives_pb2_grpc.TrainingServiceStub(channel)
    server.stop(0)
    service.close()


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_a_session_trains_saves_and_samples_over_grpc(stub, tiny_llama_dir: Path,
                                                      tmp_path: Path) -> None:
    created = stub.CreateTrainingSession(pb.CreateTrainingSessionRequest(
        base_model=str(tiny_llama_dir), lora=pb.LoraSpec(rank=4, seed=1)), timeout=120)
    sid = created.session_id  # neither train_attn nor train_mlp set: both
    assert (created.info.lora_rank, created.info.lora_alpha) == (4, 8.0)
    assert set(created.info.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"}
    losses = []
    for _ in range(3):
        out = stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sid, data=DATA,
                                                             loss_function=CE), timeout=120)
        assert [len(o.logprobs) for o in out.outputs] == [4, 3]
        losses.append(out.loss)
        step = stub.OptimStep(pb.OptimStepRequest(session_id=sid, adam=ADAM), timeout=120)
        assert step.datums == 2 and step.grad_norm > 0
    assert losses[-1] < losses[0]
    info = stub.GetTrainingSession(pb.GetTrainingSessionRequest(session_id=sid)).info
    assert (info.optimizer_steps, info.pending_datums, info.policy_version) == (3, 0, 0)

    snap = stub.SaveWeightsForSampler(pb.SaveWeightsForSamplerRequest(session_id=sid,
                                                                      name="three"), timeout=120)
    assert snap.policy_version == 1 and snap.path == f"tinker://{sid}/sampler_weights/three"
    assert Path(snap.peft_directory, "adapter_config.json").is_file()
    assert Path(snap.mlx_directory, "adapters.safetensors").is_file()
    sampled = stub.Sample(pb.SampleRequest(
        session_id=sid, policy_version=1, prompt_token_ids=[5, 9, 12],
        sampling=common_pb2.SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=7)),
        timeout=120)
    assert sampled.sampled_by == "trainer" and len(sampled.samples) == 3
    assert {(s.adapter_version, s.adapter_name) for s in sampled.samples} == {(1, sid)}
    assert all(len(s.logprobs) == len(s.token_ids) for s in sampled.samples)

    state = stub.SaveState(pb.SaveStateRequest(session_id=sid, name="s3"), timeout=120)
    assert Path(state.directory, "optimizer.pt").is_file()
    code, details = code_of(lambda: stub.OptimStep(pb.OptimStepRequest(session_id=sid,
                                                                       adam=ADAM)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no forward_backward" in details
    stub.LoadState(pb.LoadStateRequest(session_id=sid, path=state.path, with_optimizer=True),
                   timeout=120)
    resumed = stub.CreateTrainingSession(pb.CreateTrainingSessionRequest(
        base_model=str(tiny_llama_dir), state_path=state.path, with_optimizer=True), timeout=120)
    assert resumed.info.optimizer_steps == 3
    a = stub.Forward(pb.ForwardRequest(session_id=sid, data=DATA, loss_function=CE))
    b = stub.Forward(pb.ForwardRequest(session_id=resumed.session_id, data=DATA,
                                       loss_function=CE))
    assert a.loss == b.loss

    stub.CloseTrainingSession(pb.CloseTrainingSessionRequest(session_id=sid), timeout=60)
    code, _ = code_of(lambda: stub.GetTrainingSession(pb.GetTrainingSessionRequest(
        session_id=sid)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_bad_requests_name_the_field(stub, tiny_llama_dir: Path) -> None:
    sid = stub.CreateTrainingSession(pb.CreateTrainingSessionRequest(
        base_model=str(tiny_llama_dir), lora=pb.LoraSpec(rank=2, train_attn=True)),
        timeout=120).session_id
    info = stub.GetTrainingSession(pb.GetTrainingSessionRequest(session_id=sid)).info
    assert set(info.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    cases = {
        "loss_function: is unspecified": pb.ForwardBackwardRequest(session_id=sid, data=DATA),
        "data[0].weights: 2 values for 4 input tokens": pb.ForwardBackwardRequest(
            session_id=sid, loss_function=CE, data=[pb.Datum(
                input_token_ids=[5, 9, 12, 7], target_token_ids=[9, 12, 7, 2], weights=[1, 1])]),
        "data[0].advantages: the importance_sampling loss needs it": pb.ForwardBackwardRequest(
            session_id=sid, loss_function=pb.LOSS_FUNCTION_IMPORTANCE_SAMPLING, data=DATA),
        "loss_fn_config.clip_high_threshold: must be a finite number >= 1, got 0.5":
            pb.ForwardBackwardRequest(session_id=sid, loss_function=pb.LOSS_FUNCTION_PPO,
                                      data=DATA, loss_config=pb.LossConfig(
                                          clip_high_threshold=0.5)),
        "data[0].advantages: the cispo loss needs it": pb.ForwardBackwardRequest(
            session_id=sid, loss_function=pb.LOSS_FUNCTION_CISPO, data=DATA),
        "loss_fn_config.beta: must be a finite number >= 0, got -1.0": pb.ForwardBackwardRequest(
            session_id=sid, loss_function=pb.LOSS_FUNCTION_DRO, data=DATA,
            loss_config=pb.LossConfig(beta=-1.0)),
    }
    for message, request in cases.items():
        code, details = code_of(lambda r=request: stub.ForwardBackward(r, timeout=60))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    # cispo and dro over gRPC: on policy (sampling logprobs = the model's own) both are
    # cross_entropy weighted by the advantages (the ratio is 1, the penalty 0)
    own = stub.Forward(pb.ForwardRequest(session_id=sid, loss_function=CE, data=DATA),
                       timeout=60)
    rl = [pb.Datum(input_token_ids=d.input_token_ids, target_token_ids=d.target_token_ids,
                   advantages=[0.5] * len(d.input_token_ids),
                   sampling_logprobs=list(o.logprobs)) for d, o in zip(DATA, own.outputs,
                                                                      strict=True)]
    weighted_ce = -0.5 * sum(sum(o.logprobs) for o in own.outputs)
    for function, config in ((pb.LOSS_FUNCTION_CISPO, pb.LossConfig(clip_low_threshold=0.9)),
                             (pb.LOSS_FUNCTION_DRO, pb.LossConfig(beta=0.4))):
        got = stub.Forward(pb.ForwardRequest(session_id=sid, loss_function=function, data=rl,
                                             loss_config=config), timeout=60).loss
        assert got == pytest.approx(weighted_ce, rel=1e-5), function
    code, details = code_of(lambda: stub.OptimStep(pb.OptimStepRequest(
        session_id=sid, adam=pb.AdamParams(learning_rate=0))))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "adam.learning_rate: out of range: 0.0")
    code, details = code_of(lambda: stub.Sample(pb.SampleRequest(
        session_id=sid, policy_version=4, prompt_token_ids=[1],
        sampling=common_pb2.SamplingParams(max_tokens=2))))
    assert code == grpc.StatusCode.NOT_FOUND and "no policy version 4" in details
    code, details = code_of(lambda: stub.CreateTrainingSession(pb.CreateTrainingSessionRequest(
        base_model=str(tiny_llama_dir), state_path="tinker://x/sampler_weights/y")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("state_path:")


@pytest.mark.slow
@pytest.mark.parametrize("node_backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_samples_go_to_the_node_serving_the_version_and_equal_the_trainers(
        node_backend: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """On a torch node and on an MLX node (which gets each snapshot converted to mlx-lm's
    layout); the trainer's samples of the versions no node serves equal the torch node's."""
    from gridrl.models import model_identity
    from gridrl.rollout.server import NodeConfig, RolloutNode
    from gridrl.trainer.fleet.pool import NodePool
    from gridrl.trainer.primitives.fleet import FleetRoute

    if node_backend == "torch":
        from gridrl.engine.backends.torch.backend import TorchBackend

        backend = TorchBackend.from_pretrained(tiny_llama_dir)
    else:
        from gridrl.engine.backends.mlx.backend import MlxBackend

        backend = MlxBackend.from_pretrained(tiny_llama_dir, device="cpu")
    node = RolloutNode(backend, NodeConfig(
        listen="127.0.0.1:0", grace_s=1, adapter_root=tmp_path / "node-adapters")).start()
    identity = model_identity(tiny_llama_dir)
    pool = NodePool(master=None, addresses=[node.address], model_identity=identity,
                    wait_for_nodes_s=30)
    pool.start()
    pool.wait_for_nodes(1, timeout_s=60)
    fleet = FleetRoute(pool, model_path=str(tiny_llama_dir.resolve()), identity=identity)
    service = PrimitivesService(root=tmp_path / "api", load_model=torch_loader("cpu", "auto"),
                                lora_alpha=8, fleet=fleet)
    server = serve(service)
    try:
        with dial(server.address) as channel, dial(node.address) as node_channel:
            stub = primitives_pb2_grpc.TrainingServiceStub(channel)
            node_info = rollout_pb2_grpc.RolloutServiceStub(node_channel).GetNodeInfo
            sid = stub.CreateTrainingSession(pb.CreateTrainingSessionRequest(
                base_model=str(tiny_llama_dir), lora=pb.LoraSpec(rank=4, train_attn=True,
                                                                 train_mlp=True)),
                timeout=120).session_id

            def sample(version: int) -> primitives_pb2.SampleResponse:
                return stub.Sample(pb.SampleRequest(
                    session_id=sid, policy_version=version, prompt_token_ids=[5, 9, 12, 7],
                    sampling=common_pb2.SamplingParams(n=4, max_tokens=6, temperature=1.0,
                                                       seed=21)), timeout=120)

            base = sample(0)  # nothing pushed: the node serves the base model
            assert base.sampled_by == node.address
            versions = {}
            for v in (1, 2):
                stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sid, data=DATA,
                                                               loss_function=CE), timeout=120)
                stub.OptimStep(pb.OptimStepRequest(session_id=sid, adam=ADAM), timeout=120)
                snap = stub.SaveWeightsForSampler(pb.SaveWeightsForSamplerRequest(
                    session_id=sid), timeout=120)
                assert (snap.policy_version, list(snap.nodes_synced)) == (v, [node.address])
                serving = node_info(rollout_pb2.GetNodeInfoRequest(), timeout=30).info.adapter
                assert (serving.name, serving.version) == (sid, v)
                versions[v] = sample(v)
                assert versions[v].sampled_by == node.address
                assert {s.adapter_version for s in versions[v].samples} == {v}
            # version 1 and the base model are no longer on the node: the trainer samples
            # them, with the node's seeds, so the samples are the (torch) node's
            for v, on_node in ((1, versions[1]), (0, base)):
                here = sample(v)
                assert here.sampled_by == "trainer"
                if node_backend != "torch":
                    continue
                assert [list(s.token_ids) for s in here.samples] == [
                    list(s.token_ids) for s in on_node.samples]
                for a, b in zip(here.samples, on_node.samples, strict=True):
                    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs,
                                                          strict=True)) < 1e-4
    finally:
        server.stop(0)
        service.close()
        node.stop(1)


@pytest.mark.parametrize("node_backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_a_node_samples_an_adapter_with_a_head_lora_as_the_trainer_does(
        node_backend: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """train_unembed: the snapshot pushed to a node carries the LoRA on lm_head, and the node
    applies it: a torch node's samples (its seeds) are the trainer's own, whose sampler
    applies it too; the sampled tokens' logprobs (torch and MLX nodes) are peft's on the
    snapshot, and the head's LoRA moves them far more than the bound."""
    import numpy as np

    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.models import model_identity
    from gridrl.rollout.server import NodeConfig, RolloutNode
    from gridrl.trainer.fleet.pool import NodePool
    from gridrl.trainer.primitives.fleet import FleetRoute
    from gridrl.trainer.primitives.types import (
        AdamSettings,
        Datum,
        LoraRequest,
        LossSpec,
        SamplingSpec,
    )

    if node_backend == "torch":
        backend = TorchBackend.from_pretrained(tiny_llama_dir)
    else:
        from gridrl.engine.backends.mlx.backend import MlxBackend

        backend = MlxBackend.from_pretrained(tiny_llama_dir, device="cpu")
    node = RolloutNode(backend, NodeConfig(
        listen="127.0.0.1:0", grace_s=1, adapter_root=tmp_path / "node-adapters")).start()
    identity = model_identity(tiny_llama_dir)
    pool = NodePool(master=None, addresses=[node.address], model_identity=identity,
                    wait_for_nodes_s=30)
    pool.start()
    pool.wait_for_nodes(1, timeout_s=60)
    fleet = FleetRoute(pool, model_path=str(tiny_llama_dir.resolve()), identity=identity)
    service = PrimitivesService(root=tmp_path / "api", load_model=torch_loader("cpu", "auto"),
                                lora_alpha=8, fleet=fleet)
    try:
        info = service.create_model(str(tiny_llama_dir), LoraRequest(
            rank=4, train_unembed=True)).result(timeout=120)
        assert "lm_head" in info.target_modules
        data = [Datum.of(np.array([5, 9, 12, 7]), np.array([9, 12, 7, 2]))]
        for _ in range(2):
            service.forward(info.model_id, data, LossSpec("cross_entropy"),
                            backward=True).result(timeout=120)
            service.optim_step(info.model_id, AdamSettings(lr=2e-2)).result(timeout=120)
        snap = service.save_for_sampler(info.model_id).result(timeout=120)
        assert snap.nodes_synced == [node.address]
        target = service.base_target(info.model_id, snap.version)
        spec = SamplingSpec(n=4, max_tokens=6, temperature=1.0, seed=21)
        on_node = service.sample(target, [5, 9, 12, 7], spec).result(timeout=120)
        here = service.sample(target, [5, 9, 12, 7], spec,
                              prompt_logprobs=True).result(timeout=120)  # the trainer's
        assert (on_node.sampled_by, here.sampled_by) == (node.address, "trainer")
        if node_backend == "torch":
            assert [s.token_ids for s in here.sequences] == [
                s.token_ids for s in on_node.sequences]
            for a, b in zip(here.sequences, on_node.sequences, strict=True):
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs,
                                                      strict=True)) < 1e-4
        # the head's LoRA matters far beyond that 1e-4: without it (its B zeroed, in peft)
        # the sampled tokens' logprobs move by more than 1e-2
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        ids = [5, 9, 12, 7, *on_node.sequences[0].token_ids]
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, dtype=torch.float32), str(snap.peft_dir)).eval()

        def sampled_logprobs() -> np.ndarray:
            with torch.no_grad():
                lp = torch.log_softmax(peft(torch.tensor([ids])).logits[0], -1)
            return lp[torch.arange(3, len(ids) - 1), torch.tensor(ids[4:])].numpy()

        with_head = sampled_logprobs()
        np.testing.assert_allclose(with_head, on_node.sequences[0].logprobs, rtol=0, atol=1e-4)
        with torch.no_grad():
            peft.base_model.model.lm_head.lora_B["default"].weight.zero_()
        assert np.abs(sampled_logprobs() - with_head).max() > 1e-2
    finally:
        service.close()
        node.stop(1)
