"""The run's configuration: every ``gridrl-trainer run`` flag, validated, saved as
``config.json`` in the run directory and restored by ``--resume``.

Defaults are the reference single-machine setting (1 prompt per step, groups of 8, 40 new
tokens, temperature 1, LoRA r16/alpha 32 on all linear layers, AdamW lr 1e-4, clip 0.2, 16
greedy eval tasks every 10 steps).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gridrl.common.errors import invalid_argument

# Fields a resumed run may take from the new command line (where the nodes are, how long to
# run, how to serve); everything that shapes the learning comes from the saved config.
RESUME_OVERRIDABLE = frozenset({
    "steps", "master", "rollout", "listen", "metrics_port", "request_timeout_s",
    "sync_deadline_s", "min_nodes", "node_wait_s", "eval_every", "checkpoint_every",
    "keep_checkpoints", "device", "threads", "log_level", "report_to",
})


@dataclass
class TrainConfig:
    """Every setting of a run (see ``gridrl-trainer run --help`` for each flag)."""

    # model and task
    model: str = "smollm2-135m-instruct"
    task: str = "reverse-words"
    min_words: int = 3
    max_words: int = 6
    system_prompt: str | None = None
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    eval_file: str | None = None
    reward_files: list[str] = field(default_factory=list)
    reward_weights: str | None = None
    # GRPO
    steps: int = 60
    prompts_per_step: int = 1
    group_size: int = 8
    max_tokens: int = 40
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    scale_rewards: bool = True
    advantage_eps: float = 1e-4
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_beta: float = 0.0
    loss_aggregation: str = "sequence"
    micro_batch_size: int = 0
    # optimiser
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    # LoRA
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    rslora: bool = False
    # rollouts, sync, staleness
    master: str | None = None
    rollout: list[str] = field(default_factory=list)
    sync_every: int = 1
    max_staleness: int | None = None
    async_steps: int = 0
    mismatch_kl_max: float = 0.01
    mismatch_kl_max_16bit: float = 0.1
    flag_after: int = 2
    min_nodes: int = 1
    node_wait_s: float = 120.0
    request_timeout_s: float = 120.0
    sync_deadline_s: float = 30.0
    # eval, checkpoints, run directory
    eval_every: int = 10
    eval_tasks: int = 16
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    seed: int = 0
    run_dir: str | None = None
    run_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    listen: str = "127.0.0.1:50052"
    metrics_port: int = 9402
    log_level: str = "info"
    report_to: list[str] = field(default_factory=list)  # experiment trackers (trackers.py)
    # TLS files, accepted credentials and token (gridrl.common.security.Security): given by
    # every start's flags, never saved in config.json.
    security: Any = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ derived

    @property
    def local(self) -> bool:
        """True when rollouts are sampled in-process (``--rollout local``)."""
        return self.rollout == ["local"]

    @property
    def staleness_bound(self) -> int:
        """``--max-staleness``, or by default the largest staleness the cadence itself
        produces: ``(sync_every - 1) + async_steps`` (nodes get version ``v`` only at syncs,
        and prefetched rollouts are ``async_steps`` steps old)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return (0 if self.local else self.sync_every - 1) + self.async_steps

    # ------------------------------------------------------------------ checks and I/O

    def finalize(self) -> TrainConfig:
        """Fill defaults that depend on other fields (run name and directory, ``--rollout
        local`` when no node source is given) and validate. Returns self.

        Raises:
            StatusError: INVALID_ARGUMENT naming the flag.
        """
        if not self.rollout and not self.master:
            self.rollout = ["local"]
        if self.run_name is None:
            self.run_name = time.strftime("grpo-%Y%m%d-%H%M%S")
        if self.run_dir is None:
            self.run_dir = str(Path("runs") / self.run_name)
        from gridrl.trainer.trackers import parse_report_to

        self.report_to = parse_report_to(self.report_to)
        self.validate()
        return self

    def validate(self) -> None:
        """Raise INVALID_ARGUMENT (``StatusError``) naming the first bad flag."""
        positive = {"--steps": self.steps, "--prompts-per-step": self.prompts_per_step,
                    "--max-tokens": self.max_tokens, "--lora-rank": self.lora_rank,
                    "--sync-every": self.sync_every, "--eval-every": self.eval_every,
                    "--eval-tasks": self.eval_tasks, "--checkpoint-every": self.checkpoint_every,
                    "--keep-checkpoints": self.keep_checkpoints, "--flag-after": self.flag_after}
        for flag, value in positive.items():
            if value < 1:
                raise invalid_argument(flag, f"must be >= 1, got {value}")
        if self.group_size < 2:
            raise invalid_argument("--group-size", f"must be >= 2 (GRPO compares samples within "
                                                   f"a group), got {self.group_size}")
        if self.temperature <= 0:
            raise invalid_argument("--temperature", "must be > 0 (GRPO needs sampled, not greedy, "
                                                    f"rollouts), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise invalid_argument("--top-p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise invalid_argument("--top-k", f"must be >= 0, got {self.top_k}")
        if self.lr <= 0:
            raise invalid_argument("--lr", f"must be > 0, got {self.lr}")
        if self.clip_eps <= 0 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise invalid_argument("--clip-eps", "clip ranges must be > 0")
        if self.kl_beta < 0:
            raise invalid_argument("--kl-beta", f"must be >= 0, got {self.kl_beta}")
        if self.loss_aggregation not in ("sequence", "token", "constant"):
            raise invalid_argument("--loss-aggregation", "must be sequence, token or constant")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise invalid_argument("--lr-schedule", "must be constant, linear or cosine")
        if not 0 <= self.lora_dropout < 1:
            raise invalid_argument("--lora-dropout", "must be in [0, 1)")
        if self.micro_batch_size < 0 or self.warmup_steps < 0 or self.async_steps < 0:
            raise invalid_argument("--micro-batch-size/--warmup-steps/--async-steps",
                                   "must be >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise invalid_argument("--max-staleness", "must be >= 0")
        if self.run_name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name):
            raise invalid_argument("--run-name", f"{self.run_name!r} must match [A-Za-z0-9._-]+ "
                                                 "(it names the adapter on the nodes)")
        if "local" in self.rollout and (len(self.rollout) > 1 or self.master):
            raise invalid_argument("--rollout", "'local' cannot be mixed with remote nodes")
        if self.local and self.async_steps:
            raise invalid_argument("--async-steps", "needs remote nodes: the local sampler "
                                                    "shares the weights being trained")
        if self.max_staleness is not None and self.max_staleness < self.staleness_floor():
            raise invalid_argument("--max-staleness", f"{self.max_staleness} is below "
                                   f"{self.staleness_floor()}, the staleness that --sync-every "
                                   f"{self.sync_every} and --async-steps {self.async_steps} "
                                   "produce: every such sample would be dropped")

    def staleness_floor(self) -> int:
        """Staleness the sync cadence and prefetching produce on healthy nodes."""
        return (0 if self.local else self.sync_every - 1) + self.async_steps

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, without ``security`` (credentials are never saved)."""
        d = dataclasses.asdict(dataclasses.replace(self, security=None))
        del d["security"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (older or newer runs)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"security"}
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, path: Path) -> None:
        """Write ``config.json`` atomically (without ``security``)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TrainConfig:
        """Read a saved ``config.json``."""
        return cls.from_dict(json.loads(path.read_text()))
