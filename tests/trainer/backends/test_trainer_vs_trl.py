"""One fixed batch (same prompts, completions, advantages, LoRA weights) through gridrl's GRPO
update and through TRL's ``GRPOTrainer`` loss: the loss and every LoRA gradient agree to float32
rounding, for the loss aggregations the two share (gridrl ``sequence`` = TRL ``grpo``, ``token``
= ``bnpo``, ``constant`` = ``dr_grpo``). TRL is a bench-only extra
(``services/trainer[bench]``); without it these tests are skipped."""

from __future__ import annotations

import copy

import pytest
import torch
from float_bounds import (
    EPS32,
    ROUNDING_REL,
    assert_tensors_close_to_largest,
    assert_within,
    max_abs,
    max_error,
)

trl = pytest.importorskip("trl")

from gridrl.trainer.backends.base import TrainSequence, UpdateConfig  # noqa: E402
from gridrl.trainer.backends.torch.policy import LoraSettings, load_policy  # noqa: E402
from gridrl.trainer.backends.torch.update import (  # noqa: E402
    collate,
    grpo_update,
    make_optimizer,
    make_scheduler,
    sequence_logprobs,
)
from gridrl.trainer.grpo import advantages as grpo  # noqa: E402

GROUPS, GROUP_SIZE, MAX_TOKENS, TEMPERATURE = 2, 4, 6, 0.9
TRL_LOSS = {"sequence": "grpo", "token": "bnpo", "constant": "dr_grpo"}


class _GradientRecorder(torch.optim.SGD):
    """An optimizer whose step records the gradients and changes nothing (lr 0)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=0.0)
        self.params = params
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for p in self.params]


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    pol = load_policy(str(tiny_llama_dir), lora=LoraSettings(rank=4, alpha=8), seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA B starts at 0: give it values so A's gradient is not zero
        for name, p in pol.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return pol


def _batch(policy, cfg: UpdateConfig, seed: int = 5) -> list[TrainSequence]:
    """Two groups of four completions of different lengths with on-policy behaviour logprobs
    (the trainer's own, so gridrl's ratio is exactly TRL's 1)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(GROUPS, GROUP_SIZE, generator=g)
    adv = grpo.group_advantages(rewards.numpy())
    seqs = []
    for i in range(GROUPS):
        prompt = torch.randint(7, 500, (4 + 3 * i,), generator=g).tolist()
        for j in range(GROUP_SIZE):
            n = 1 + (i * GROUP_SIZE + j) % MAX_TOKENS
            comp = torch.randint(7, 500, (n,), generator=g).tolist()
            seqs.append(TrainSequence(tuple(prompt), tuple(comp), tuple([0.0] * n),
                                      float(adv[i, j]), i))
    own = sequence_logprobs(policy, seqs, cfg)
    return [TrainSequence(s.prompt_ids, s.completion_ids, tuple(lp), s.advantage, s.group)
            for s, lp in zip(seqs, own, strict=True)]


def _trl_trainer(policy, aggregation, tmp_path, **settings):
    """A ``GRPOTrainer`` on a copy of ``policy``'s peft model (same LoRA weights)."""
    from datasets import Dataset

    model = copy.deepcopy(policy.model)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), loss_type=TRL_LOSS[aggregation], beta=0.0, epsilon=0.2,
        temperature=TEMPERATURE, max_completion_length=MAX_TOKENS,
        per_device_train_batch_size=GROUPS * GROUP_SIZE, num_generations=GROUP_SIZE,
        gradient_checkpointing=False, bf16=False, use_cpu=True, report_to=[],
        disable_dropout=True, **{"max_steps": 1, **settings})
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(
        completions), args=args, train_dataset=Dataset.from_list([{"prompt": "a b"}] * 8),
        processing_class=policy.tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _trl_inputs(policy, seqs) -> dict:
    """``seqs`` as the inputs TRL's ``_prepare_inputs`` hands to ``compute_loss``."""
    batch = collate(seqs, policy.pad_id, torch.device("cpu"))
    p_width = batch["input_ids"].shape[1] - batch["completion_ids"].shape[1]
    return {"prompt_ids": batch["input_ids"][:, :p_width],
            "prompt_mask": batch["attention_mask"][:, :p_width],
            "completion_ids": batch["completion_ids"],
            "completion_mask": batch["completion_mask"].long(),
            "advantages": batch["advantages"], "old_per_token_logps": None,
            "num_items_in_batch": batch["completion_mask"].sum()}


def _trl_loss_and_grads(policy, seqs, aggregation, tmp_path):
    trainer = _trl_trainer(policy, aggregation, tmp_path)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, _trl_inputs(policy, seqs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in sorted(trainer.model.named_parameters())
             if p.requires_grad}
    return float(loss.detach()), grads


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_one_batch_loss_and_lora_gradients_equal_trls(policy, aggregation, tmp_path):
    cfg = UpdateConfig(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, aggregation=aggregation,
                       max_grad_norm=0.0, eps_low=0.2, beta=0.0)
    seqs = _batch(policy, cfg)
    mine = copy.deepcopy(policy)
    names = [n for n, p in sorted(mine.model.named_parameters()) if p.requires_grad]
    recorder = _GradientRecorder(mine.trainable_parameters())
    stats = grpo_update(mine, recorder, None, seqs, cfg)
    trl_loss, trl_grads = _trl_loss_and_grads(policy, seqs, aggregation, tmp_path)

    assert stats.clip_fraction == 0.0 and stats.mismatch_kl < 1e-10  # on-policy: ratio 1
    assert stats.loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    assert names == sorted(trl_grads) and len(names) == len(recorder.grads) > 0
    total = sum(float(g.norm() ** 2) for g in recorder.grads) ** 0.5
    assert total > 1e-3  # a real gradient, not two zeros
    assert_tensors_close_to_largest(recorder.grads, [trl_grads[n] for n in names], ROUNDING_REL,
                                    "LoRA gradient")


STEPS, LR = 3, 1e-2


@pytest.mark.parametrize(("schedule", "weight_decay"), [("constant", 0.0), ("linear", 0.1)])
def test_three_steps_with_the_optimizer_end_at_trls_lora_weights(policy, schedule, weight_decay,
                                                                  tmp_path):
    """The optimizer side: three updates, each on its own fixed batch with on-policy behaviour
    logprobs, through gridrl's ``grpo_update`` with its AdamW and lr schedule
    (``make_optimizer``, ``make_scheduler``) and through TRL's own ``training_step`` (its loss
    and HF's backward) followed by the steps of the Trainer loop in its order (clip to
    ``max_grad_norm``, optimizer, scheduler, zero_grad). The clip is hit (pre-clip norms > 1),
    so clipping, AdamW's moments and bias correction, weight decay and the schedule all show.

    At each step the clipped gradients agree to float32 rounding (float_bounds.ROUNDING_REL);
    TRL's optimizer then steps on gridrl's gradients, so the two AdamWs get the same input and
    their weights agree to the rounding of AdamW's element-wise arithmetic (below), not to the
    CPU's summation order magnified by Adam's ``g / (|g| + eps)``, which moves an entry whose
    gradient is within rounding of zero by +-lr.
    (Warmup is not compared: HF's linear warmup gives the first step lr 0, gridrl's
    ``(step + 1) / warmup_steps`` does not spend a step on nothing.)"""
    cfg = UpdateConfig(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, aggregation="sequence",
                       max_grad_norm=1.0, eps_low=0.2, beta=0.0)
    mine = copy.deepcopy(policy)
    optimizer = make_optimizer(mine.trainable_parameters(), lr=LR, weight_decay=weight_decay)
    scheduler = make_scheduler(optimizer, schedule=schedule, warmup_steps=0, total_steps=STEPS)
    trainer = _trl_trainer(policy, "sequence", tmp_path, learning_rate=LR, max_steps=STEPS,
                           weight_decay=weight_decay, lr_scheduler_type=schedule,
                           warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch",
                           adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    trainer._prepare_inputs = lambda inputs: inputs  # the batch is given, not generated
    model = trainer.model
    trained = [(n, p) for n, p in mine.model.named_parameters() if p.requires_grad]
    before = {n: p.detach().clone() for n, p in trained}
    theirs = dict(model.named_parameters())
    clipped: list[torch.Tensor] = []  # gridrl's gradients as its AdamW gets them

    def record(optimizer, args, kwargs):
        clipped[:] = [p.grad.detach().clone() for _, p in trained]

    optimizer.register_step_pre_hook(record)
    for step in range(STEPS):
        seqs = _batch(mine, cfg, seed=5 + step)  # on-policy for the current weights
        stats = grpo_update(mine, optimizer, scheduler, seqs, cfg)
        inputs = _trl_inputs(policy, seqs)
        trainer.training_step(model, inputs, inputs["num_items_in_batch"])
        trl_norm = float(trainer._clip_grad_norm(model))
        assert trl_norm > 1.0 and stats.grad_norm == pytest.approx(trl_norm, rel=1e-4)
        assert_tensors_close_to_largest(clipped, [theirs[n].grad for n, _ in trained],
                                        ROUNDING_REL, f"step {step} clipped gradient")
        with torch.no_grad():
            for (name, _), grad in zip(trained, clipped, strict=True):
                theirs[name].grad.copy_(grad)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad()

        theirs_lr = set(trainer.lr_scheduler.get_last_lr())  # HF splits decay / no-decay groups
        assert len(theirs_lr) == 1 and scheduler.get_last_lr() == pytest.approx([*theirs_lr])
        for name, p in trained:
            # AdamW's step is element-wise, w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), with
            # |m_hat / sqrt(v_hat)| <= 1.01 in three steps (Cauchy-Schwarz on the moments' sums):
            # two implementations of it on the same gradients round each of its ~8 operations
            # to half an ulp of w or of the update, and step k carries the steps before it.
            bound = (step + 1) * 8 * EPS32 * (max_abs(p) + 2 * LR)
            assert_within(max_error(p, theirs[name]), bound, f"step {step} {name}")
            assert max_error(p, before[name]) > 0, (step, name)
