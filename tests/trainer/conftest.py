"""The trainer's tests, one folder per sub-package of ``gridrl.trainer`` (``fleet/``,
``grpo/``, ``envs/``, ``backends/``, ``primitives/``, ``report/``, ``run/``; its top-level
modules' tests here). This conftest puts this folder on ``sys.path`` (pytest's prepend import
mode), so every folder's tests import the shared helpers here: ``scripted_nodes`` (scripted
rollout nodes), ``trainer_runs`` (``gridrl-trainer run`` processes), ``flag_records``,
``lora_gradients``."""
