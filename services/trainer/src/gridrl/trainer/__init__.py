"""gridrl trainer: GRPO on a LoRA adapter with rollouts from a pool of nodes.

Read top-down: ``cli.py`` (flags, generated from ``config.py``) -> ``loop.py`` (the run:
rollouts -> admission, rewards, advantages (``batch.py``, ``grpo.py``) -> update -> sync ->
eval -> checkpoint -> record (``records.py``)). The model side is a ``TrainerBackend``
(``backend.py``); ``--backend torch`` is ``torch_backend.py`` over ``policy.py`` (model +
LoRA), ``update.py`` (one optimizer step over a padded batch, per-token maths in
``grpo_torch.py``) and ``distributed.py``. Around them: ``tasks.py``, ``rewards.py``,
``local.py``, ``evaluation.py``, ``checkpoint.py``, ``rundir.py``, ``plot.py``. Rollouts from
remote nodes come through ``pool.py`` (the RPC layer over the pure ``membership.py``
and ``scheduling.py``) and adapters go out through ``sync.py``; ``admission.py`` decides
which samples enter the update, ``monitor.py`` flags nodes and ``probation.py`` brings
flagged nodes back.

Importing this package imports neither torch nor transformers.
"""

__version__ = "0.1.0"
