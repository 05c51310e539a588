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
3). ``--max-tokens`` defaults to the task's own (:func:`gridrl.trainer.envs.loading.default_max_tokens`:
24 for reverse-words, whose answers are a few words; 40 for a JSONL task), and so does
``--eval-tasks`` (:func:`gridrl.trainer.envs.loading.default_eval_tasks`: 128 generated phrases for
reverse-words, 16 rows held out of a JSONL task). The older reference
setting (1 prompt per step, lr 1e-4, 40 new tokens; ``bench/learning.py``) barely learns in 30
steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gridrl.common import settings
from gridrl.common.address import parse_address
from gridrl.common.errors import invalid_argument
from gridrl.common.settings import NON_NEGATIVE, POSITIVE, above, at_least, setting, within
from gridrl.common.transport import ADAPTER_NAME, ADAPTER_NAME_RULE
from gridrl.trainer.envs.episode import EpisodeLimits
from gridrl.trainer.envs.loading import default_eval_tasks, default_max_tokens, make_environment

if TYPE_CHECKING:
    from gridrl.trainer.envs.base import Environment

ENV_PREFIX = "GRIDRL_TRAINER_"
# --backend name -> "module:class" of its TrainerBackend (imported when chosen).
BACKENDS: dict[str, str] = {
    "torch": "gridrl.trainer.backends.torch.backend:TorchTrainerBackend",
    "mlx": "gridrl.trainer.backends.mlx.backend:MlxTrainerBackend",
}
# --report-to name -> the module it imports; each is also the name of a gridrl-trainer extra,
# whose version range services/trainer/pyproject.toml declares.
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def _run_name(v: str) -> str | None:
    if ADAPTER_NAME.fullmatch(v):
        return None
    return f"{v!r} must be {ADAPTER_NAME_RULE} (it names the adapter on the nodes)"


def parse_report_to(value: str | Iterable[str] | None) -> list[str]:
    """``"tensorboard,wandb"`` (or a list of such strings) -> ``["tensorboard", "wandb"]``;
    ``None``, ``""`` and ``"none"`` -> ``[]``. Order kept, duplicates dropped.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--report-to`` naming an unknown tracker.
    """
    if value is None:
        return []
    parts = [value] if isinstance(value, str) else list(value)
    names: list[str] = []
    for part in parts:
        for name in (p.strip().lower() for p in part.split(",")):
            if name in ("", "none"):
                continue
            if name not in TRACKERS:
                raise invalid_argument("--report-to", f"unknown tracker {name!r}; expected a "
                                       f"comma-separated subset of {', '.join(TRACKERS)}")
            if name not in names:
                names.append(name)
    return names


@dataclass
class TrainConfig:
    """Every setting of a run (see ``gridrl-trainer run --help`` for each flag)."""

    # model and task
    model: str = setting("smollm2-135m-instruct", "Base model: alias, local Hugging Face "
                         "directory or hub id (needs a chat template).")
    task: str = setting("reverse-words", (
        "'reverse-words', 'reverse-words-retry' (two attempts with feedback), 'tool-arithmetic' "
        "(add/multiply tools), 'reasoning-gym:<dataset>', 'verifiers:<taskset>', a Python file "
        "defining an Environment, or a JSONL file with prompt (or chat messages) and answer "
        "columns."))
    task_params: str = setting("", (
        "reasoning-gym: the dataset's parameters, 'key=value,key=value'. Values: true/false/"
        "yes/no (any case), none/null, integers, floats, lists in brackets (commas inside "
        "brackets do not split pairs: operators=[+,-]), JSON, 'quoted' text, else text; e.g. "
        "min_terms=2,allow_negation=false,operators=[+,-]. An unknown key is refused with the "
        "dataset's keys."))
    max_turns: int | None = setting(
        None, "Model turns per episode at most. Default: the task's own (1 for single-turn "
        "tasks; reverse-words-retry: 2; tool-arithmetic: 4).", check=POSITIVE)
    max_episode_tokens: int = setting(
        0, "Tokens after the prompt per episode at most, model and environment turns together "
        "(0: no limit beyond --max-turns x --max-tokens and what the environment appends); a "
        "cut episode is trained on as it is and counted as truncated.", check=NON_NEGATIVE)
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
    eval_reward_files: list[str] = setting(  # noqa: RUF009 (setting() is a dataclasses.field)
        [], "Python file of reward functions that score the held-out eval instead (repeatable; "
        "default: the run's own --reward-file functions, else the task's score). The scorer "
        "is named on the console, in log.jsonl, summary.json and the plot.",
        flag="--eval-reward-file")
    on_reward_error: str = setting(
        "fail", "A reward function that raises or returns the wrong number of values mid-run: "
        "fail (checkpoint the finished steps, exit non-zero, naming the function and the "
        "step) or drop (leave that group out of the step, counted in log.jsonl's "
        "reward_error_groups).", choices=("fail", "drop"))
    # GRPO
    steps: int = setting(60, "GRPO steps (optimizer updates).", check=POSITIVE, on_resume=True)
    prompts_per_step: int = setting(2, "B: prompts (groups) per step.", check=POSITIVE)
    group_size: int = setting(8, "G: completions per prompt.", check=at_least(
        2, "GRPO compares samples within a group"))
    max_tokens: int | None = setting(
        None, "New tokens per model turn (and eval). Default: the task's own (reverse-words: "
        "24; a JSONL task: 40; reverse-words-retry: 24; tool-arithmetic: 48; reasoning-gym: "
        "32).", check=POSITIVE)
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
    skip_no_signal: bool = setting(
        False, "Leave groups whose advantages are all 0 (equal rewards) out of the update's "
        "forward and backward: the same gradient for none of their cost, but their samples' "
        "mismatch KL is not measured, so a node whose groups carry no signal is not checked "
        "(the KL penalty, --kl-beta > 0, keeps every group).",
        flag="--skip-no-signal/--no-skip-no-signal")
    memory_mb: int = setting(
        0, "MiB of resident memory the trainer may use in its update (torch and mlx "
        "backends): micro-batches are sized from the sequences' tokens and the activations "
        "per token measured at start-up, a sequence too long for it alone recomputes its "
        "activations (activation checkpointing; torch only, mlx refuses it); a budget the model and one sequence do not fit is "
        "refused before step 1, naming the least that fits. 0: 60% of the memory available "
        "at start-up (MemAvailable) on top of what the process holds. --micro-batch-size "
        "still caps the sequences of a micro-batch. With --threads 0 the update shares the "
        "cores as a rollout node does (the cores other processes leave free, re-decided "
        "between micro-batches).",
        check=NON_NEGATIVE)
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
    share_weight: float = setting(
        1.0, "This run's weight in each rollout node's fair share between the runs using it "
        "(several trainers on one fleet): while runs wait, a node gives each a share of its "
        "work proportional to its weight.", check=POSITIVE)
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
    # (formerly --node-wait-s and --wait-for-nodes-s, still taken: cli.py)
    node_wait_s: float = setting(
        120.0, "Seconds the start waits for --min-nodes rollout nodes before the run fails "
        "(before step 1).", flag="--start-wait-s", on_resume=True)
    wait_for_nodes_s: float = setting(
        300.0, "Seconds the run waits, once started, when no rollout node is in rotation "
        "(every node dead, restarting or benched) before it fails; 0: fail at once.",
        flag="--outage-wait-s", check=NON_NEGATIVE, on_resume=True)
    request_timeout_s: float = setting(120.0, "Deadline of one Generate.", on_resume=True)
    keepalive_s: float = setting(
        10.0, "Seconds between HTTP/2 keepalive pings on the trainer's channels to nodes and "
        "the master; a node or master whose link vanished (Wi-Fi down, lid closed) is noticed "
        "after about --keepalive-s + --keepalive-timeout-s and its calls fail (their groups go "
        "to other nodes).", check=at_least(1), on_resume=True)
    keepalive_timeout_s: float = setting(
        5.0, "Seconds a keepalive ping may go unanswered before the connection is dropped.",
        check=above(0), on_resume=True)
    hedge_after: float = setting(
        0.0, "Start a backup copy of a group on another node once it has run this many times "
        "its node's measured group latency (and at least --hedge-min-s); the first answer "
        "wins, the other call is cancelled. 0: never hedge (groups on a node that leaves "
        "rotation are re-dispatched at once either way).", check=NON_NEGATIVE,
        on_resume=True)
    hedge_min_s: float = setting(
        10.0, "Seconds a group runs at least before it may be hedged (--hedge-after).",
        check=NON_NEGATIVE, on_resume=True)
    sync_deadline_s: float = setting(30.0, "Deadline of one node's push.", on_resume=True)
    relay: bool = setting(
        True, "Relay fan-out: upload each adapter push once (to one node) and let the nodes "
        "pass it on, each checking it against the trainer's digests (node credentials need "
        "--address); --no-relay: push to every node.", flag="--relay/--no-relay")
    # eval, checkpoints, run directory
    eval_every: int = setting(10, "Held-out greedy eval every N steps.", check=POSITIVE,
                              on_resume=True)
    eval_tasks: int | None = setting(
        None, "Held-out eval prompts, reported with the eval's standard error. Default: the "
        "task's own (reverse-words: 128, a standard error <= 0.025 for the scores its runs "
        "see; a JSONL task: 16 of its rows, or --eval-file). 280 keep it <= 0.03 whatever the "
        "scores in [0, 1].", check=POSITIVE)
    max_dropped_steps: int = setting(
        3, "Stop the run (checkpointed, exit 1, naming the cause) after this many steps in a "
        "row where every episode was dropped (e.g. the environment raising in each); 0: never.",
        check=NON_NEGATIVE)
    no_signal_warn_steps: int = setting(
        3, "Warn (console, dashboard) when this many steps in a row had no group with signal "
        "(equal rewards in every group: nothing is learned); 0: never.", check=NON_NEGATIVE)
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
    # TLS files, accepted credentials and token (gridrl.common.security.policy.Security): given by
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

    def environment(self) -> Environment:
        """The environment ``--task`` names, built with the task flags
        (:func:`gridrl.trainer.envs.loading.make_environment`; needs no model).

        Raises:
            StatusError: INVALID_ARGUMENT on ``--task`` (unknown name, a missing extra naming
                what to install, an unknown dataset, a broken file) or ``--task-params``.
        """
        return make_environment(self.task, seed=self.seed, eval_size=int(self.eval_tasks or 1),
                                min_words=self.min_words, max_words=self.max_words,
                                prompt_column=self.prompt_column,
                                answer_column=self.answer_column,
                                system_prompt=self.system_prompt, eval_file=self.eval_file,
                                task_params=self.task_params)

    def episode_limits(self, env: Environment) -> EpisodeLimits:
        """Turns and tokens of ``env``'s episodes: ``--max-turns`` (default the
        environment's own), ``--max-tokens`` per model turn, ``--max-episode-tokens``."""
        return EpisodeLimits(max_turns=self.max_turns or env.max_turns,
                             max_tokens=int(self.max_tokens or env.max_tokens),
                             max_episode_tokens=self.max_episode_tokens)

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
            self.max_tokens = default_max_tokens(self.task)
        if self.eval_tasks is None:
            self.eval_tasks = default_eval_tasks(self.task)
        self.report_to = parse_report_to(self.report_to)
        self.validate()
        return self

    def validate(self) -> None:
        """Raise INVALID_ARGUMENT (``StatusError``) naming the first bad flag: each setting's
        own ``choices`` and ``check`` in declaration order, then the rules between settings."""
        settings.validate(self)
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


def flag_of(name: str) -> str:
    """The flag of setting ``name`` as error messages name it (``--group-size``)."""
    return settings.flag_of(TrainConfig, name)


def default_of(name: str) -> Any:
    """The declared default of setting ``name``."""
    return settings.default_of(TrainConfig, name)


# Settings a resumed run may take from the new command line.
RESUME_OVERRIDABLE = frozenset(f.name for f, s in settings.settings_of(TrainConfig)
                               if s.on_resume)


def click_options(f: Any) -> Any:
    """Decorate a click command with one option per setting declared with ``cli=True``, in
    declaration order (:func:`gridrl.common.settings.click_options`)."""
    return settings.click_options(TrainConfig, ENV_PREFIX)(f)
