"""gridrl trainer: GRPO on a LoRA adapter with rollouts from a pool of nodes.

Read top-down:

- ``cli.py`` (flags, generated from ``config.py``; ``preflight.py`` checks the inputs before
  the model loads) -> ``run/`` (``driver.train``: :func:`~gridrl.trainer.run.build.build_run`
  wires a typed ``Run``, ``run/loop.py`` steps it: rollouts -> batch -> update -> sync ->
  eval -> one ``StepRecord`` -> checkpoint; the run directory and checkpoints);
- what a step's data goes through, in one direction: ``envs/`` (the one task API: an
  ``Environment`` gives items and scores episodes; ``envs/loading.py`` builds the one
  ``--task`` names: reverse-words, a JSONL file, tools, reasoning-gym, verifiers, a user's
  file) -> ``envs/source.py`` (``EpisodeSource``: ``group_size`` episodes per item, run by
  ``envs/episode.py`` over a turn sampler: ``fleet/`` (the rollout nodes: pool, membership,
  scheduling, adapter sync, monitor, probation, the wire) or ``local.py`` (``--rollout
  local``)) -> ``rollouts.py`` (what a rollout is: ``RolloutSample``, ``Group``,
  ``StepRollouts``, ``group_seed``) -> ``rewards.py`` (TRL-signature reward functions, combined)
  -> ``grpo/`` (admission, advantages, the step's batch) -> ``backends/`` (the model side:
  ``TrainerBackend``, torch and MLX); ``evaluation.py`` (held-out eval: greedy episodes of the
  environment's held-out items);
- what a run tells: ``report/`` (typed records and events, one subscriber list: log.jsonl,
  trackers, ``RunStatus``, Prometheus, the console, the summary and the plot) and
  ``server.py`` (TrainerService over ``RunStatus``); ``demo.py`` is ``make demo``.

Layers, no cycles (``make lint``: import-linter's acyclic contract): ``cli`` -> ``run`` ->
``report`` -> ``fleet``, ``config`` -> ``backends`` -> ``grpo`` -> ``rollouts``, with
``envs``, ``rewards``, ``evaluation`` and ``local`` beside them; each imports only what is to
its right. Importing this package imports neither torch nor transformers; only
``backends/torch`` and ``backends/mlx`` do.
"""

__version__ = "0.1.0"
