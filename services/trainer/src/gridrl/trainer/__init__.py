"""gridrl trainer: GRPO on a peft LoRA adapter with rollouts from a pool of nodes.

Read top-down: ``cli.py`` (flags) -> ``loop.py`` (the run: rollouts -> rewards -> advantages ->
update -> sync -> eval -> checkpoint) -> the learning core (``grpo.py`` maths, ``update.py``
one optimizer step over a padded batch, ``policy.py`` model + LoRA) and the parts around it
(``tasks.py``, ``rewards.py``, ``local.py``, ``evaluation.py``, ``checkpoint.py``, ``rundir.py``,
``plot.py``, ``distributed.py``). Rollouts from remote nodes come through ``pool.py`` (the RPC
layer over the pure ``membership.py`` and ``scheduling.py``) and adapters go out through
``sync.py``; ``admission.py`` decides which samples enter the update, ``monitor.py`` flags
nodes and ``probation.py`` brings flagged nodes back.

Importing this package imports neither torch nor transformers.
"""

__version__ = "0.1.0"
