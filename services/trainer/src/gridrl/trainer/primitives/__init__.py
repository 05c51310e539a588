"""Training primitives on the trainer's own weights (``gridrl-trainer serve-api``): a caller's
training loop drives forward / forward-backward with a loss chosen by name, AdamW steps,
saved states and snapshots for sampling, and samples routed to the rollout nodes.

Read top-down: ``serve.py`` (the command: one gRPC server, one HTTP server) ->
``grpc_servicer.py`` (``TrainingService``, protos/gridrl/v1/primitives.proto) and
``tinker_http.py`` (the Tinker-compatible REST endpoints; what they mean in
``tinker_facade.py``, request ids, futures and order in ``tinker_requests.py``, their wire
format in ``tinker_wire.py``) -> ``service.py``
(:class:`~gridrl.trainer.primitives.service.PrimitivesService`: the models, their thread,
snapshots) and ``routing.py`` (who samples a version) -> ``model.py`` (the framework seam;
torch: ``torch_model.py``). Pure pieces, tested without RPC or threads:
``types.py`` (datums, losses, Adam and sampling settings, their checks), ``ordering.py`` (a
client's requests run in its sequence order), ``futures.py`` (request ids and long polls),
``stops.py`` (stop strings), ``paths.py`` (``tinker://`` paths and the directories behind them).

Importing this package imports neither torch nor the Tinker SDK.
"""
