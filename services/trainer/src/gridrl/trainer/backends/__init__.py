"""The trainer's model side.

``base.py``: the ``TrainerBackend`` interface (load, sample, score, update, adapter and
checkpoint files, data parallelism), the types it trades (``TrainSequence``, ``UpdateConfig``,
``UpdateStats``, ``LoraSettings``) and ``backend_class`` (the ``--backend`` name's class, from
``gridrl.trainer.config.BACKENDS``). One sub-package per tensor framework (``torch/``,
``mlx/``), imported only when ``--backend`` chooses it.
"""
