"""The run's configuration: every ``gridrl-trainer run`` setting, declared once.

Each setting is one field of :class:`TrainConfig`, declared with :func:`setting`: its default,
its help text and its constraint. From that one declaration come

- the click option of ``gridrl-trainer run`` (:func:`click_options`): the flag
  ``--<field-name>`` (``--x/--no-x`` for booleans; ``flag=`` overrides), its type from the
  annotation (``int``, ``float``, ``str``, ``bool``; ``list[str]``: repeatable; ``choices``: a
  choice), its default, its help and its ``GRIDRL_TRAINER_<FLAG>`` environment variable;
- the validation (:meth:`TrainConfig.validate`): ``choices`` and ``check`` raise
  INVALID_ARGUMENT naming the flag; rules that tie several settings together are written out
  in ``validate`` after the per-setting ones;
- what ``--resume`` may change (``on_resume=True``: where the nodes are, how long to run, how
  to serve; everything that shapes the learning comes from the saved ``config.json``);
- ``config.json`` in the run directory (:meth:`TrainConfig.save`, restored by ``--resume``).

Adding a setting is one ``setting(...)`` line here; the loop or the backend then reads
``cfg.<name>``. A setting whose flag a shared decorator declares (``--listen``,
``--metrics-port``, ``--log-level`` from ``gridrl.common.cli.server_options``) is declared with
``cli=False`` so it is saved and validated without a second option. ``security`` (TLS files,
accepted credentials, the token sent) is no setting: every start takes it from its own flags and
it is never saved.

Defaults are settings that learn: ``gridrl-trainer run`` with no hyper-parameter flag lifts the
bundled SmolLM2-135M's held-out reverse-words eval from ~0.06 to 0.6-0.9 in 60 steps (2 prompts
per step, groups of 8, temperature 1, LoRA r16/alpha 32 on all linear layers, AdamW lr 3e-4,
clip 0.2, 3-4 word phrases, a greedy eval every 10 steps; docs/benchmarks.md, section
3). ``--max-tokens`` defaults to the task's own (:func:`gridrl.trainer.tasks.default_max_tokens`:
24 for reverse-words, whose answers are a few words; 40 for a JSONL task), and so does
``--eval-tasks`` (:func:`gridrl.trainer.tasks.default_eval_tasks`: 128 generated phrases for
reverse-words, 16 rows held out of a JSONL task). The older reference
setting (1 prompt per step, lr 1e-4, 40 new tokens; ``bench/learning.py``) barely learns in 30
steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.common.errors import invalid_argument
from gridrl.trainer.backend import BACKENDS

ENV_PREFIX = "GRIDRL_TRAINER_"
_SETTING = "gridrl.setting"


@dataclass(frozen=True)
class Setting:
    """How one :class:`TrainConfig` field is exposed and checked (see the module docstring).

    Attributes:
        help: the flag's help text.
        flag: the flag's declaration when it is not ``--<field-name>`` (e.g. ``--reward-file``
            for ``reward_files``; ``--x/--no-x`` for a boolean).
        choices: the allowed values (a click choice, checked by ``validate``).
        check: ``check(value) -> problem or None``, for values that are not None.
        cli: False when a shared decorator declares the flag.
        on_resume: a resumed run takes this setting from the new command line.
    """

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    cli: bool = True
    on_resume: bool = False


def setting(default: Any, help: str, **how: Any) -> Any:
    """A :class:`TrainConfig` field with its :class:`Setting` (keyword arguments ``how``)."""
    meta = {_SETTING: Setting(help=help, **how)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def at_least(low: float, why: str = "") -> Callable[[Any], str | None]:
    """``value >= low``; ``why`` is added to the message in parentheses."""
    note = f" ({why})" if why else ""
    return lambda v: None if v >= low else f"must be >= {low}{note}, got {v}"


def above(low: float, why: str = "") -> Callable[[Any], str | None]:
    """``value > low``."""
    note = f" ({why})" if why else ""
    return lambda v: None if v > low else f"must be > {low}{note}, got {v}"


def within(low: float, high: float, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[Any], str | None]:
    """``low <= value <= high`` (either end open when asked)."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(v: Any) -> str | None:
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        return None if ok else f"must be in {interval}, got {v}"

    return check


def _run_name(v: str) -> str | None:
    from gridrl.common.transport import ADAPTER_NAME, ADAPTER_NAME_RULE

    if ADAPTER_NAME.fullmatch(v):
        return None
    return f"{v!r} must be {ADAPTER_NAME_RULE} (it names the adapter on the nodes)"


POSITIVE = at_least(1)
NON_NEGATIVE = at_least(0)


@dataclass
class TrainConfig:
    """Every setting of a run (see ``gridrl-trainer run --help`` for each flag)."""

    # model and task
    model: str = setting("smollm2-135m-instruct", "Base model: alias, local Hugging Face "
                         "directory or hub id (needs a chat template).")
    task: str = setting("reverse-words",
                        "'reverse-words' or a JSONL file with prompt/answer columns.")
    min_words: int = setting(3, "reverse-words: fewest words per phrase.")
    max_words: int = setting(4, "reverse-words: most words per phrase.")
    system_prompt: str | None = setting(None, "System message (default: the task's own; "
                                        "reverse-words has one with a worked example).")
    prompt_column: str = setting("prompt", "JSONL task: the prompt column.")
    answer_column: str = setting("answer", "JSONL task: the answer column.")
    eval_file: str | None = setting(None, "JSONL task: held-out eval rows (default: "
                                    "--eval-tasks rows held out of --task).")
    reward_files: list[str] = setting(  # noqa: RUF009 (setting() is a dataclasses.field)
        [], "Python file of TRL-signature reward functions f(prompts, completions, **columns) "
        "-> list[float] (repeatable; replaces the task's score).", flag="--reward-file")
    reward_weights: str | None = setting(
        None, "Comma-separated weight per reward function (default: all 1).")
    # GRPO
    steps: int = setting(60, "GRPO steps (optimizer updates).", check=POSITIVE, on_resume=True)
    prompts_per_step: int = setting(2, "B: prompts (groups) per step.", check=POSITIVE)
    group_size: int = setting(8, "G: completions per prompt.", check=at_least(
        2, "GRPO compares samples within a group"))
    max_tokens: int | None = setting(
        None, "New tokens per completion (and eval). Default: the task's own (reverse-words: 24; "
        "a JSONL task: 40).", check=POSITIVE)
    temperature: float = setting(
        1.0, "Sampling temperature; the trainer's logprobs use logits / temperature too.",
        check=above(0, "GRPO needs sampled, not greedy, rollouts"))
    top_p: float = setting(1.0, "Nucleus sampling mass.", check=within(0, 1, low_open=True))
    top_k: int = setting(0, "Top-k sampling (0: off).", check=NON_NEGATIVE)
    scale_rewards: bool = setting(
        True, "Divide advantages by the group's reward std (GRPO) or not (Dr. GRPO).",
        flag="--scale-rewards/--no-scale-rewards")
    advantage_eps: float = setting(1e-4, "Added to the std before dividing.")
    clip_eps: float = setting(0.2, "PPO clip range (lower side).", check=above(0))
    clip_eps_high: float | None = setting(
        None, "Upper clip range (DAPO clip-higher; default: --clip-eps).", check=above(0))
    kl_beta: float = setting(
        0.0, "Coefficient of the k3 KL to the reference (base) policy; 0: off.",
        check=NON_NEGATIVE)
    loss_aggregation: str = setting(
        "sequence", "sequence: mean per sequence then mean (GRPO); token: over all tokens "
        "(DAPO); constant: / (N * max_tokens) (Dr. GRPO).",
        choices=("sequence", "token", "constant"))
    is_correction: str = setting(
        "none", "Importance-sampling correction against the behaviour logprobs (stale or "
        "16-bit samples): none (PPO clip against the behaviour policy only), tis (truncated "
        "IS, Yao et al. 2025), mis (masked IS).", choices=("none", "tis", "mis"))
    is_level: str = setting("token", "Importance ratio per token or per sequence.",
                            choices=("token", "sequence"))
    is_cap: float = setting(
        2.0, "Cap C of the importance ratio: tis truncates to C, mis drops tokens (or "
        "sequences) above C.", check=above(0))
    micro_batch_size: int = setting(
        0, "Sequences per forward/backward (0: all of a step at once).", check=NON_NEGATIVE)
    # optimiser
    lr: float = setting(3e-4, "AdamW learning rate.", check=above(0))
    weight_decay: float = setting(0.0, "AdamW weight decay.")
    lr_schedule: str = setting("constant", "Learning-rate schedule after warmup.",
                               choices=("constant", "linear", "cosine"))
    warmup_steps: int = setting(0, "Linear warmup steps.", check=NON_NEGATIVE)
    max_grad_norm: float = setting(1.0, "Gradient clipping (0: off).")
    # LoRA
    lora_rank: int = setting(16, "LoRA rank r.", check=POSITIVE)
    lora_alpha: float = setting(32.0, "LoRA alpha.")
    lora_dropout: float = setting(0.0, "LoRA dropout.", check=within(0, 1, high_open=True))
    lora_target_modules: str = setting(
        "all-linear", "'all-linear' or comma-separated module names (q_proj,v_proj).")
    rslora: bool = setting(False, "Rank-stabilised LoRA scaling.", flag="--rslora/--no-rslora")
    # rollouts, sync, staleness
    master: str | None = setting(
        None, "Master host:port: use the rollout nodes it registers (WatchNodes).",
        on_resume=True)
    rollout: list[str] = setting(  # noqa: RUF009 (setting() is a dataclasses.field)
        [], "Rollout node host:port (repeatable), or 'local' to sample in-process (default "
        "when no --master).", on_resume=True)
    sync_every: int = setting(1, "Push the adapter to every node every N steps.",
                              check=POSITIVE)
    max_staleness: int | None = setting(
        None, "Drop samples more than this many versions behind the trainer (default: "
        "(sync-every - 1) + async-steps).", check=NON_NEGATIVE)
    async_steps: int = setting(
        0, "Sample the next K steps' rollouts while the current step trains.",
        check=NON_NEGATIVE)
    mismatch_kl_max: float = setting(
        0.01, "Flag a node whose samples of the trainer's own version disagree with the "
        "trainer's logprobs by more than this KL (nats/token).")
    mismatch_kl_max_16bit: float = setting(
        0.1, "--mismatch-kl-max for a bf16/fp16 node or trainer (its rounding: ~1e-2).")
    flag_after: int = setting(2, "Consecutive stale or mismatched steps that flag a node.",
                              check=POSITIVE)
    min_nodes: int = setting(1, "Rollout nodes to wait for before step 1.", on_resume=True)
    node_wait_s: float = setting(120.0, "Seconds to wait for them.", on_resume=True)
    wait_for_nodes_s: float = setting(
        300.0, "Seconds the run waits, once started, when no rollout node is in rotation "
        "(every node dead, restarting or benched) before it fails; 0: fail at once.",
        check=NON_NEGATIVE, on_resume=True)
    request_timeout_s: float = setting(120.0, "Deadline of one Generate.", on_resume=True)
    sync_deadline_s: float = setting(30.0, "Deadline of one node's push.", on_resume=True)
    # eval, checkpoints, run directory
    eval_every: int = setting(10, "Held-out greedy eval every N steps.", check=POSITIVE,
                              on_resume=True)
    eval_tasks: int | None = setting(
        None, "Held-out eval prompts, reported with the eval's standard error. Default: the "
        "task's own (reverse-words: 128, a standard error <= 0.025 for the scores its runs "
        "see; a JSONL task: 16 of its rows, or --eval-file). 280 keep it <= 0.03 whatever the "
        "scores in [0, 1].", check=POSITIVE)
    checkpoint_every: int = setting(10, "Checkpoint every K steps.", check=POSITIVE,
                                    on_resume=True)
    keep_checkpoints: int = setting(2, "Checkpoints kept.", check=POSITIVE, on_resume=True)
    seed: int = setting(0, "Seed of data order, sampling and LoRA init.")
    run_dir: str | None = setting(None, "Run directory (default: runs/<run-name>).")
    run_name: str | None = setting(
        None, "Run name, also the adapter name on nodes (default: grpo-<time>).",
        check=_run_name)
    # where and how the trainer computes
    backend: str = setting("torch", "Trainer backend: the framework that holds the weights "
                           "and trains them. torch: transformers + peft (CUDA, CPU; torchrun "
                           "for data parallelism). mlx: mlx-lm's LoRA layers (Apple Silicon; "
                           "Linux CPU with mlx[cpu], slow), one process; its --device is auto, "
                           "gpu or cpu, its --dtype auto keeps the stored dtype.",
                           choices=tuple(BACKENDS))
    device: str = setting("auto", "auto, cpu, cuda, cuda:1...", on_resume=True)
    dtype: str = setting("auto", "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16.")
    update_dtype: str = setting(
        "float32", "Dtype of the update's forward and backward (torch autocast); the LoRA master "
        "weights, their gradients and the AdamW state stay float32. bfloat16 pays on CUDA and "
        "on CPUs with AMX or AVX-512-bf16; it raises the mismatch KL against float32 nodes "
        "(the 16-bit bound applies).", choices=("float32", "bfloat16"))
    threads: int = setting(
        0, "torch intra-op CPU threads (0: torch's default, one per core). On a machine "
        "shared with rollout nodes, give each process its share.", check=NON_NEGATIVE,
        on_resume=True)
    # serving (flags from gridrl.common.cli.server_options)
    listen: str = setting("127.0.0.1:50052", "TrainerService host:port.", cli=False,
                          on_resume=True)
    metrics_port: int = setting(9402, "Prometheus /metrics port.", cli=False, on_resume=True)
    log_level: str = setting("info", "Logging level.", cli=False, on_resume=True)
    # experiment trackers (trackers.py): the flag takes "tensorboard,wandb"; finalize() makes
    # it a list
    report_to: str | list[str] = setting(  # noqa: RUF009 (setting() is a dataclasses.field)
        "none", "Experiment trackers for the per-step metrics, comma-separated: tensorboard, "
        "wandb, trackio (optional extras: pip install 'gridrl-trainer[wandb]'...), or none. "
        "TRL's metric names (train/reward, eval/reward...).", on_resume=True)
    # TLS files, accepted credentials and token (gridrl.common.security.Security): given by
    # every start's flags, never saved in config.json.
    security: Any = dataclasses.field(default=None, repr=False, compare=False)

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
        return self.staleness_floor()

    def staleness_floor(self) -> int:
        """Staleness the sync cadence and prefetching produce on healthy nodes."""
        return (0 if self.local else self.sync_every - 1) + self.async_steps

    # ------------------------------------------------------------------ checks and I/O

    def finalize(self) -> TrainConfig:
        """Fill defaults that depend on other fields (run name and directory, ``--rollout
        local`` when no node source is given, the task's ``--max-tokens``) and validate.
        Returns self.

        Raises:
            StatusError: INVALID_ARGUMENT naming the flag.
        """
        if not self.rollout and not self.master:
            self.rollout = ["local"]
        if self.run_name is None:
            self.run_name = time.strftime("grpo-%Y%m%d-%H%M%S")
        if self.run_dir is None:
            self.run_dir = str(Path("runs") / self.run_name)
        if self.max_tokens is None:
            from gridrl.trainer.tasks import default_max_tokens

            self.max_tokens = default_max_tokens(self.task)
        if self.eval_tasks is None:
            from gridrl.trainer.tasks import default_eval_tasks

            self.eval_tasks = default_eval_tasks(self.task)
        from gridrl.trainer.trackers import parse_report_to

        self.report_to = parse_report_to(self.report_to)
        self.validate()
        return self

    def validate(self) -> None:
        """Raise INVALID_ARGUMENT (``StatusError``) naming the first bad flag: each setting's
        own ``choices`` and ``check`` in declaration order, then the rules between settings."""
        for f, s in _settings():
            value = getattr(self, f.name)
            if value is None:
                continue
            if s.choices is not None and value not in s.choices:
                allowed = " or ".join(filter(None, (", ".join(s.choices[:-1]), s.choices[-1])))
                raise invalid_argument(flag_of(f.name), f"must be {allowed}, got {value!r}")
            problem = s.check(value) if s.check is not None else None
            if problem:
                raise invalid_argument(flag_of(f.name), problem)
        from gridrl.common.address import parse_address

        for flag, address in [("--master", self.master),
                              *(("--rollout", a) for a in self.rollout if a != "local")]:
            if address is not None:
                parse_address(address, flag)
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


def _settings() -> list[tuple[dataclasses.Field, Setting]]:
    """Every declared field of :class:`TrainConfig` with its :class:`Setting`, in order."""
    return [(f, f.metadata[_SETTING]) for f in dataclasses.fields(TrainConfig)
            if _SETTING in f.metadata]


def flag_of(name: str) -> str:
    """The flag of setting ``name`` as error messages name it (``--group-size``)."""
    s = TrainConfig.__dataclass_fields__[name].metadata[_SETTING]
    return (s.flag or "--" + name.replace("_", "-")).split("/")[0]


def default_of(name: str) -> Any:
    """The declared default of setting ``name``."""
    f = TrainConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# Settings a resumed run may take from the new command line.
RESUME_OVERRIDABLE = frozenset(f.name for f, s in _settings() if s.on_resume)


def click_options(f: Any) -> Any:
    """Decorate a click command with one option per setting declared with ``cli=True``, in
    declaration order (see the module docstring)."""
    import click

    from gridrl.common.cli import env_option

    hints = typing.get_type_hints(TrainConfig)
    for field, s in reversed(_settings()):
        if not s.cli:
            continue
        flag = s.flag or "--" + field.name.replace("_", "-")
        env = ENV_PREFIX + flag.split("/")[0].removeprefix("--").replace("-", "_").upper()
        kind = hints[field.name]
        kw: dict[str, Any] = {"help": s.help}
        if typing.get_origin(kind) is list:
            kw["multiple"] = True
        else:
            default = default_of(field.name)
            kw["default"] = default
            kw["show_default"] = default is not None
            base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
            if s.choices is not None:
                kw["type"] = click.Choice(list(s.choices))
            elif base is not bool:
                kw["type"] = base
        f = env_option(flag, field.name, env=env, **kw)(f)
    return f
