"""gridrl master: the registry of rollout nodes and trainers (who is up, what they serve,
which adapter version they hold). Pure Python plus gRPC: no torch, no mlx, no numpy.

Modules, top-down: ``cli`` (click commands) -> ``server`` (gRPC servicer and wiring) ->
``registry`` (thread-safe state, liveness, watch events), ``validate`` (request checks),
``store`` (sqlite persistence), ``metrics`` (Prometheus), ``display`` (the ``nodes`` table);
the dashboard: ``reports`` (RunReportService) -> ``runs`` (the runs' bounded record, typed in
``run_model``, converted from the protos and to the page's and the store's JSON in ``run_wire``)
and ``dashboard`` (its HTTP server, credentials and fleet rows; the page in ``static/``).
"""
