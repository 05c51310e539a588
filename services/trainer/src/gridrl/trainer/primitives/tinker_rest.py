"""Tinker's RestClient on gridrl (SDK ``tinker`` 0.38, ``lib/public_interfaces/rest_client.py``):
training runs, checkpoints (listing, weights info, TTL, deletion, download URLs) and
sessions, answered from the trainer's disk
(:class:`~gridrl.trainer.primitives.checkpoints.CheckpointStore`) and the facade's sessions.
What cannot apply to machines a team owns (publishing to a hub, billing, projects, audit
logs) is refused at once by name (400), never a hang.

Each method takes the request's path parameters and query (or JSON body) and returns the JSON
the SDK's pydantic type reads (``TrainingRun``, ``Checkpoint``, ``CheckpointsListResponse``,
``WeightsInfoResponse``, ``ExternalWeightsUrlsResponse``, ``GetSessionResponse``...). Errors are
:class:`~gridrl.common.errors.StatusError` s: NOT_FOUND (404) naming the run, session or
``tinker://`` path (unknown, deleted or expired), INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from gridrl.common.errors import invalid_argument
from gridrl.trainer.primitives import paths
from gridrl.trainer.primitives.checkpoints import TINKER_TYPE, Checkpoint, parse_checkpoint_id

if TYPE_CHECKING:
    from gridrl.trainer.primitives.tinker_facade import TinkerFacade

OWNER = "gridrl"  # TrainingRun.model_owner: the runs are the trainer machine's
URL_LIFETIME_S = 7 * 24 * 3600.0  # file URLs do not expire; the SDK wants a time
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
# Refused by name: path prefix under /api/v1 -> the feature
NOT_ON_OWNED_MACHINES = {
    "billing": "billing (an owned machine bills no one)",
    "audit": "audit logs of an organisation",
    "sessions/search": "session search (list_sessions and get_session work)",
    "project": "projects",
    "trace_export": "session trace export",
    "publish": "publishing checkpoints to a hub (save_weights_external and "
               "get_external_weights_urls give the files)",
}


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat()


def _page(query: dict[str, str], default_limit: int) -> tuple[int, int]:
    try:
        limit = int(query.get("limit", default_limit))
        offset = int(query.get("offset", 0))
    except ValueError as e:
        raise invalid_argument("limit", f"limit and offset must be integers: {e}") from None
    if limit < 0 or offset < 0:
        raise invalid_argument("limit", "limit and offset must be >= 0")
    return limit, offset


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    """Tinker's ``Checkpoint``."""
    return {"checkpoint_id": f"{c.where.kind}/{c.where.name}",
            "checkpoint_type": TINKER_TYPE[c.where.kind], "time": _iso(c.created),
            "tinker_path": c.where.uri, "size_bytes": c.size_bytes, "public": False,
            "expires_at": _iso(c.expires_at)}


class TinkerRest:
    """The RestClient's endpoints over a facade (its sessions, samplers and checkpoints)."""

    def __init__(self, facade: TinkerFacade) -> None:
        self.facade = facade
        self.store = facade.checkpoints

    # ---------------------------------------------------------------- runs

    def training_run(self, run_id: str) -> dict[str, Any]:
        """Tinker's ``TrainingRun`` of ``run_id`` (NOT_FOUND naming it)."""
        run = self.store.run(run_id)
        checkpoints = self.store.checkpoints(run_id)
        last = {kind: next((checkpoint_json(c) for c in checkpoints if c.where.kind == kind),
                           None) for kind in (paths.STATE, paths.SAMPLER)}
        open_now = run_id in self.facade.service.models()
        newest = max([run["created"], *(c.created for c in checkpoints)])
        return {"training_run_id": run_id, "base_model": run["base_model"],
                "model_owner": OWNER, "is_lora": True, "corrupted": False,
                "lora_rank": run.get("lora_rank"),
                "last_request_time": _iso(dt.datetime.now(dt.UTC).timestamp() if open_now
                                          else newest),
                "last_checkpoint": last[paths.STATE],
                "last_sampler_checkpoint": last[paths.SAMPLER],
                "user_metadata": run.get("user_metadata")}

    def training_runs(self, query: dict[str, str]) -> dict[str, Any]:
        """Tinker's ``TrainingRunsResponse``: runs newest first, paged."""
        limit, offset = _page(query, 20)
        runs = self.store.runs()
        page = [self.training_run(r["model_id"]) for r in runs[offset:offset + limit]]
        return {"training_runs": page,
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    # ---------------------------------------------------------------- checkpoints

    def checkpoints(self, run_id: str | None, query: dict[str, str]) -> dict[str, Any]:
        """Tinker's ``CheckpointsListResponse``: one run's (``run_id``; NOT_FOUND naming an
        unknown run) or every run's checkpoints, newest first."""
        if run_id is not None:
            self.store.run(run_id)
            return {"checkpoints": [checkpoint_json(c) for c in self.store.checkpoints(run_id)]}
        limit, offset = _page(query, 100)
        found = self.store.checkpoints()
        return {"checkpoints": [checkpoint_json(c) for c in found[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}

    def weights_info(self, body: dict[str, Any]) -> dict[str, Any]:
        """Tinker's ``WeightsInfoResponse`` of ``body["tinker_path"]``."""
        where = paths.parse(str(body.get("tinker_path", "")), "tinker_path")
        meta = self.store.get(where).meta
        targets = {str(t).rsplit(".", 1)[-1] for t in meta.get("target_modules", [])}
        if "all-linear" in targets:
            targets = ATTENTION | MLP
        return {"base_model": meta["base_model"], "is_lora": True,
                "lora_rank": int(meta["lora_rank"]), "optimizer_config": {"type": "adamw"},
                "train_attn": bool(targets & ATTENTION), "train_mlp": bool(targets & MLP),
                "train_unembed": "lm_head" in targets}

    def delete(self, run_id: str, checkpoint_id: str) -> None:
        """Delete a checkpoint's files (NOT_FOUND naming its path)."""
        where = parse_checkpoint_id(run_id, checkpoint_id)
        self.store.delete(where)
        self.facade.forget_checkpoint(where)

    def set_ttl(self, run_id: str, checkpoint_id: str, body: dict[str, Any]) -> None:
        """Expire a checkpoint ``body["ttl_seconds"]`` from now (None: never); the server
        deletes it then."""
        ttl = body.get("ttl_seconds")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
            raise invalid_argument("ttl_seconds", f"must be a number of seconds, got {ttl!r}")
        self.store.set_ttl(parse_checkpoint_id(run_id, checkpoint_id), ttl)

    def external_weights_urls(self, run_id: str, checkpoint_id: str) -> dict[str, Any]:
        """Tinker's ``ExternalWeightsUrlsResponse``: a ``file://`` URL per file of the
        checkpoint (readable on the trainer's machine, or wherever its disk is mounted)."""
        where = parse_checkpoint_id(run_id, checkpoint_id)
        checkpoint = self.store.get(where)
        expires = checkpoint.expires_at or dt.datetime.now(dt.UTC).timestamp() + URL_LIFETIME_S
        return {"urls": self.store.file_urls(where), "expires": _iso(expires)}

    def storage_usage(self) -> dict[str, Any]:
        """Tinker's ``CurrentCheckpointStorageUsageResponse``: the live checkpoints' count and
        bytes on the trainer's disk (no rate, no cost: nobody bills an owned disk)."""
        found = self.store.checkpoints()
        size = sum(c.size_bytes for c in found)
        return {"effective_rate_usd_per_gigabyte_month": None,
                "data": [{"checkpoint_count": len(found), "size_bytes": size,
                          "size_gigabytes": size / 1e9, "estimated_monthly_cost_usd": None}]}

    # ---------------------------------------------------------------- sessions

    def sessions(self, query: dict[str, str]) -> dict[str, Any]:
        """Tinker's ``ListSessionsResponse``: the live sessions' ids, paged."""
        limit, offset = _page(query, 20)
        return {"sessions": self.facade.session_ids()[offset:offset + limit]}

    def session(self, session_id: str) -> dict[str, Any]:
        """Tinker's ``GetSessionResponse`` (NOT_FOUND naming an unknown session)."""
        models, samplers = self.facade.session_contents(session_id)
        return {"training_run_ids": models, "sampler_ids": samplers}

    # ---------------------------------------------------------------- routing

    def route(self, method: str, rest: str, query: dict[str, str], body: Any) -> Any:
        """Answer ``method /api/v1/<rest>`` for the RestClient's paths (``training_runs...``,
        ``checkpoints``, ``weights_info``, ``sessions...``).

        Raises:
            KeyError: not a RestClient path (the caller answers 404 or refuses by name).
        """
        parts = rest.strip("/").split("/")
        if parts[0] == "training_runs":
            if len(parts) == 1 and method == "GET":
                return self.training_runs(query)
            run_id = parts[1]
            if len(parts) == 2 and method == "GET":
                return self.training_run(run_id)
            if len(parts) == 3 and parts[2] == "checkpoints" and method == "GET":
                return self.checkpoints(run_id, query)
            if len(parts) >= 5 and parts[2] == "checkpoints":
                checkpoint_id, action = "/".join(parts[3:5]), parts[5:]
                if not action and method == "DELETE":
                    return self.delete(run_id, checkpoint_id)
                if action == ["ttl"] and method in ("PUT", "POST"):
                    return self.set_ttl(run_id, checkpoint_id, body or {})
                if action == ["external_weights_urls"] and method == "GET":
                    return self.external_weights_urls(run_id, checkpoint_id)
        if rest == "billing/usage/checkpoints/current" and method == "GET":
            return self.storage_usage()
        if rest == "checkpoints" and method == "GET":
            return self.checkpoints(None, query)
        if rest == "weights_info" and method == "POST":
            return self.weights_info(body or {})
        if parts[0] == "sessions" and "search" not in parts:
            if len(parts) == 1 and method == "GET":
                return self.sessions(query)
            if len(parts) == 2 and method == "GET":
                return self.session(parts[1])
        raise KeyError(rest)


def refused_feature(rest: str) -> str | None:
    """The feature a RestClient path asks for that owned machines do not have, or None."""
    for key, feature in NOT_ON_OWNED_MACHINES.items():
        if rest.startswith(key) or f"/{key}" in rest:
            return feature
    return None

