"""One training run: wiring, stepping, ending, and what it leaves on disk.

Read top-down: ``driver.py`` (:func:`~gridrl.trainer.run.driver.train`: build, step, finish /
stop / fail, close) -> ``build.py`` (:func:`~gridrl.trainer.run.build.build_run`: the typed
:class:`~gridrl.trainer.run.build.Run` of collaborators) -> ``loop.py`` (the steps: rollouts ->
batch -> update -> sync -> eval -> one record -> checkpoint). Beside them: ``state.py`` (step,
policy version, lineage), ``steps.py`` (each step's prompts and rollouts, sampled up to
``--async-steps`` ahead), ``ranks.py`` (data parallelism: what rank 0 sends, what
the other ranks do), ``control.py`` (the stop request and every stop / resume message),
``watch.py`` (runs that cannot learn: every episode dropped, no group with signal),
``rundir.py`` (the run directory, ``log.jsonl``) and ``checkpoint.py`` (atomic checkpoints).

Importing this package imports nothing; none of its modules imports a tensor framework.
"""
