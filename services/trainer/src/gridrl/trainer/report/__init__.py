"""What a run reports, and to whom: typed records and events, one subscriber list.

The run emits one :class:`~gridrl.trainer.report.records.StepRecord` per step and typed
events (:mod:`~gridrl.trainer.report.events`) through a
:class:`~gridrl.trainer.report.reporter.Reporter`; each output is a subscriber
(:class:`~gridrl.trainer.report.reporter.RunSubscriber`: ``on_step(record)``,
``on_event(event)``, ``close()``): ``log.jsonl`` (``gridrl.trainer.run.rundir.LogFile``),
``trackers.py`` (TensorBoard, W&B, Trackio), ``status.py`` (``RunStatus``: GetRunStatus,
WatchRun), ``metrics.py`` (Prometheus), ``summary.py`` (the records in memory: the plot,
``plot.py``, and ``summary.json``) and ``console.py`` (the terminal). Adding an output is one
more subscriber (see ``reporter.py`` for the calling rules).
"""
