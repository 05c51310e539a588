"""The primitives behind both wires: :class:`PrimitivesService`.

It owns the training models (one :class:`~gridrl.trainer.primitives.model.TrainableModel`
each, held as a :class:`~gridrl.trainer.primitives.model.ModelEntry`), their training, and
their snapshots (policy versions 1, 2, ... on disk, see :mod:`gridrl.trainer.primitives.paths`;
files written by :mod:`gridrl.trainer.primitives.snapshots`). Who samples a version (the
rollout nodes when they serve it, else the trainer on its own copy of the weights) is its
:class:`~gridrl.trainer.primitives.routing.SampleRouter`'s.

Every method returns a ``concurrent.futures.Future`` at once. Work on a model's weights runs on
one thread, ``primitives-model``, in the order it was submitted (so a caller that submits in
its order gets that order; the HTTP facade releases a client's requests in its ``seq_id``
order first, :mod:`gridrl.trainer.primitives.tinker_requests`). The saved checkpoints as
Tinker's RestClient sees them (listings, TTLs, deletion) are
:mod:`gridrl.trainer.primitives.checkpoints`. Errors are
:class:`gridrl.common.errors.StatusError` s set on the future (NOT_FOUND for an unknown model,
INVALID_ARGUMENT naming the field, FAILED_PRECONDITION, RESOURCE_EXHAUSTED).

Threads and locks: ``_lock`` guards the model table and the snapshot index (held for
microseconds, never during model work or I/O); the model thread alone touches a model's
weights, its optimizer and the snapshot directories.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

from gridrl.common.errors import (
    StatusError,
    failed_precondition,
    invalid_argument,
    not_found,
    resource_exhausted,
)
from gridrl.trainer.backends.base import LoraSettings
from gridrl.trainer.primitives import paths
from gridrl.trainer.primitives.fleet import FleetRoute
from gridrl.trainer.primitives.local_sampling import SampleTarget
from gridrl.trainer.primitives.model import ModelEntry
from gridrl.trainer.primitives.routing import ModelLoader, SampleRouter
from gridrl.trainer.primitives.snapshots import (
    EXTERNAL_FILE,
    KEEP_UNNAMED,
    SNAPSHOT_FILE,
    Snapshot,
    lora_targets,
    read_state,
    write_dir,
    write_mlx,
)
from gridrl.trainer.primitives.types import (
    HEAD_MODULE,
    AdamSettings,
    Datum,
    ForwardResult,
    LoraRequest,
    LossSpec,
    ModelInfo,
    OptimResult,
    SampleResult,
    SamplingSpec,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

ATTENTION_MODULES = "q_proj,k_proj,v_proj,o_proj"
MLP_MODULES = "gate_proj,up_proj,down_proj"


class PrimitivesService:
    """Training models, their snapshots and samples.

    Args:
        root: directory of saved states and sampler weights (created).
        load_model: loads a base model with a fresh adapter (the framework's).
        lora_alpha: LoRA alpha of every new adapter (the update is scaled by alpha / rank).
        seed: default seed of adapters' initialisation.
        fleet: the rollout nodes, or None (the trainer samples everything).
        max_models: training models open at once.
    """

    def __init__(self, *, root: Path, load_model: ModelLoader, lora_alpha: float = 32.0,
                 seed: int = 0, fleet: FleetRoute | None = None, max_models: int = 4) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lora_alpha = lora_alpha
        self.seed = seed
        self.fleet = fleet
        self.max_models = max_models
        self._load_model = load_model
        self._lock = threading.Lock()
        self._models: dict[str, ModelEntry] = {}
        self._snapshots: dict[str, tuple[str, int]] = {}  # sampler uri -> (model id, version)
        self._model_thread = futures.ThreadPoolExecutor(1, thread_name_prefix="primitives-model")
        self._closed = False
        self.router = SampleRouter(fleet=fleet, load_model=load_model, seed=seed,
                                   open_model=self._open_entry, open_models=self._open_entries,
                                   submit=self._on_model_thread)

    # ---------------------------------------------------------------- models

    def create_model(self, base_model: str | None, lora: LoraRequest, *,
                     model_id: str | None = None, state: paths.WeightsPath | None = None,
                     with_optimizer: bool = False) -> futures.Future[ModelInfo]:
        """Load ``base_model`` with a fresh adapter of ``lora`` (or, with ``state``, the
        adapter and optionally the optimizer of a saved state, on the state's base model when
        ``base_model`` is None) as model ``model_id`` (None: a new id). Resolves to its
        :class:`ModelInfo`."""
        def job() -> ModelInfo:
            lora.check()
            with self._lock:
                if model_id in self._models:
                    raise invalid_argument("model_id", f"{model_id} exists")
                if len(self._models) >= self.max_models:
                    raise resource_exhausted(
                        f"{len(self._models)} training models are open (--max-models "
                        f"{self.max_models}); close a session or unload a model first")
            mid = model_id or f"ts-{uuid.uuid4().hex[:12]}"
            saved, settings, base = None, self._lora_settings(lora), base_model
            if state is not None:
                saved, settings, saved_base = read_state(self.root, state)
                base = base or saved_base
            if not base:
                raise invalid_argument("base_model", "is empty")
            try:
                model = self._load_model(base, settings,
                                         self.seed if lora.seed is None else lora.seed)
            except StatusError:
                raise
            except (OSError, ValueError) as e:
                raise invalid_argument("base_model", f"{base!r}: {e}") from e
            entry = ModelEntry(model, mid, base, base_files=model.adapter_files())
            if saved is not None:
                model.load_state_files(saved, with_optimizer=with_optimizer)
                entry.live = None
            with self._lock:
                self._models[mid] = entry
            info = self._info(entry)
            log.info("training model %s: %s, LoRA rank %d on %s", mid, base, settings.rank,
                     ",".join(info.target_modules))
            return info

        return self._on_model_thread(job)

    def info(self, model_id: str) -> ModelInfo:
        """What model ``model_id`` is now (no waiting).

        Raises:
            StatusError: NOT_FOUND.
        """
        return self._info(self._entry(model_id))

    def close_model(self, model_id: str) -> futures.Future[None]:
        """Release a model (its saved files stay); after the work queued before it."""
        def job() -> None:
            with self._lock:
                entry = self._models.pop(model_id, None)
            if entry is not None:
                entry.model.close()
                log.info("training model %s closed", model_id)

        return self._on_model_thread(job)

    def models(self) -> list[str]:
        """Ids of the open models."""
        with self._lock:
            return sorted(self._models)

    # ---------------------------------------------------------------- training

    def forward(self, model_id: str, data: Sequence[Datum], loss: LossSpec, *,
                backward: bool) -> futures.Future[ForwardResult]:
        """Score ``data`` (and with ``backward`` accumulate the loss's gradient)."""
        def job() -> ForwardResult:
            entry = self._entry(model_id)
            return entry.model.forward(data, loss, backward=backward)

        return self._on_model_thread(job)

    def optim_step(self, model_id: str, adam: AdamSettings) -> futures.Future[OptimResult]:
        """One AdamW step on the accumulated gradient."""
        def job() -> OptimResult:
            entry = self._entry(model_id)
            result = entry.model.optim_step(adam)
            entry.live = None
            return result

        return self._on_model_thread(job)

    def save_state(self, model_id: str, name: str) -> futures.Future[str]:
        """Write adapter and optimizer state as ``name``; resolves to its ``tinker://`` path."""
        def job() -> str:
            entry = self._entry(model_id)
            where = paths.WeightsPath(model_id, paths.STATE, paths.check_name(name))
            files = entry.model.state_files()
            files["state.json"] = json.dumps(self._describe(entry), indent=2).encode()
            write_dir(files, where.directory(self.root))
            return where.uri

        return self._on_model_thread(job)

    def load_state(self, model_id: str, where: paths.WeightsPath, *,
                   with_optimizer: bool) -> futures.Future[None]:
        """Replace the model's adapter (and optimizer) by a saved state."""
        def job() -> None:
            entry = self._entry(model_id)
            files, settings, _ = read_state(self.root, where)
            if (settings.rank, settings.target_modules) != (
                    entry.model.lora_rank, lora_targets(entry.model.target_modules)):
                raise failed_precondition(f"{where.uri}: saved with LoRA rank {settings.rank} "
                                          f"on {settings.target_modules}; {model_id} has rank "
                                          f"{entry.model.lora_rank}")
            entry.model.load_state_files(files, with_optimizer=with_optimizer)
            entry.live = None

        return self._on_model_thread(job)

    # ---------------------------------------------------------------- sampling

    def save_for_sampler(self, model_id: str, name: str | None = None
                         ) -> futures.Future[Snapshot]:
        """Snapshot the adapter as the model's next policy version: written under
        ``sampler_weights/<name>`` (unnamed: ``v<version>``, peft layout only, the last
        :data:`KEEP_UNNAMED` kept) and pushed to the fleet when the model owns it."""
        def job() -> Snapshot:
            entry = self._entry(model_id)
            version = entry.version + 1
            where = paths.WeightsPath(model_id, paths.SAMPLER,
                                      paths.check_name(name) if name else f"v{version}")
            directory = where.directory(self.root)
            files = entry.model.adapter_files()
            peft_dir = write_dir(files, directory / "peft")
            layers = entry.model.identity.num_layers
            mlx_dir = (write_mlx(files, directory / "mlx", entry.model_id, layers,
                                 entry.model.model_path) if name else None)
            (directory / SNAPSHOT_FILE).write_text(json.dumps(
                {**self._describe(entry), "policy_version": version}, indent=2))
            synced = None
            if self.fleet is not None:
                synced = self.fleet.push(model_id, entry.model.model_path, version, files)
            with self._lock:
                entry.version, entry.live = version, version
                entry.versions[version] = directory
                self._snapshots[where.uri] = (model_id, version)
                dropped = self._drop_old_unnamed(entry, version) if not name else []
            for old in dropped:
                shutil.rmtree(old, ignore_errors=True)
            return Snapshot(version, where.uri, peft_dir, mlx_dir, synced or [])

        return self._on_model_thread(job)

    def save_external(self, model_id: str, name: str) -> futures.Future[str]:
        """Export the adapter for use outside gridrl as ``external_weights/<name>``: the peft
        layout (``peft/``, what HuggingFace peft and vLLM load) and the mlx-lm layout
        (``mlx/``), with ``external.json`` (base model, LoRA settings). Not a policy version,
        not pushed to the fleet. Resolves to its ``tinker://`` path."""
        def job() -> str:
            entry = self._entry(model_id)
            where = paths.WeightsPath(model_id, paths.EXTERNAL, paths.check_name(name))
            directory = where.directory(self.root)
            files = entry.model.adapter_files()
            write_dir(files, directory / "peft")
            write_mlx(files, directory / "mlx", entry.model_id,
                      entry.model.identity.num_layers, entry.model.model_path)
            (directory / EXTERNAL_FILE).write_text(json.dumps(self._describe(entry), indent=2))
            return where.uri

        return self._on_model_thread(job)

    def _drop_old_unnamed(self, entry: ModelEntry, version: int) -> list[Path]:
        entry.unnamed.append(version)
        dropped = []
        while len(entry.unnamed) > KEEP_UNNAMED:
            old = entry.unnamed.pop(0)
            directory = entry.versions.pop(old)
            self._snapshots.pop(paths.WeightsPath(entry.model_id, paths.SAMPLER,
                                                  directory.name).uri, None)
            dropped.append(directory)
        return dropped

    def sampler_target(self, uri: str) -> SampleTarget:
        """What a ``tinker://.../sampler_weights/<name>`` path samples.

        Raises:
            StatusError: INVALID_ARGUMENT for a malformed path, NOT_FOUND when nothing was
                saved there.
        """
        where = paths.parse(uri, "model_path", kind=paths.SAMPLER)
        with self._lock:
            known = self._snapshots.get(where.uri)
            entry = self._models.get(where.model_id)
        directory = where.directory(self.root)
        meta_file = directory / SNAPSHOT_FILE
        if known is not None and entry is not None and meta_file.is_file():
            return SampleTarget(entry.base_model, where.model_id, known[1])
        if not meta_file.is_file():
            raise not_found(f"{uri}: no sampler weights there (dropped, or never saved)")
        meta = json.loads(meta_file.read_text())
        return SampleTarget(meta["base_model"], None, int(meta["policy_version"]),
                            directory / "peft")

    def base_target(self, model_id: str, version: int) -> SampleTarget:
        """The target of ``version`` of an open model (0: its base model).

        Raises:
            StatusError: NOT_FOUND for an unknown model or version.
        """
        entry = self._entry(model_id)
        if version != 0 and version not in entry.versions:
            raise not_found(f"{model_id} has no policy version {version} (newest "
                            f"{entry.version}; unnamed snapshots are kept {KEEP_UNNAMED} deep)")
        return SampleTarget(entry.base_model, model_id, version)

    def sample(self, target: SampleTarget, prompt: Sequence[int], spec: SamplingSpec, *,
               prompt_logprobs: bool = False, topk_prompt: int = 0
               ) -> futures.Future[SampleResult]:
        """``spec.n`` samples of ``prompt`` on ``target``'s weights (:meth:`SampleRouter.sample`:
        on the rollout nodes when they serve that version, else on the trainer)."""
        return self.router.sample(target, prompt, spec, prompt_logprobs=prompt_logprobs,
                                  topk_prompt=topk_prompt)

    def tokenizer(self, base_model: str) -> Any:
        """The tokenizer of ``base_model`` (an open model's, else loaded from its directory)."""
        return self.router.tokenizer(base_model)

    # ---------------------------------------------------------------- plumbing

    def close(self) -> None:
        """Finish queued work, release every model and the fleet. Idempotent."""
        if self._closed:
            return
        self._closed = True
        samplers = self.router.close()
        self._model_thread.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            models = [e.model for e in self._models.values()] + samplers
            self._models.clear()
        for model in models:
            model.close()
        if self.fleet is not None:
            self.fleet.close()

    def _on_model_thread(self, job: Callable[[], T]) -> futures.Future[T]:
        if self._closed:
            failed: futures.Future[T] = futures.Future()
            failed.set_exception(failed_precondition("the trainer is shutting down"))
            return failed
        return self._model_thread.submit(job)

    def _open_entry(self, model_id: str) -> ModelEntry | None:
        with self._lock:
            return self._models.get(model_id)

    def _open_entries(self) -> list[ModelEntry]:
        with self._lock:
            return list(self._models.values())

    def _entry(self, model_id: str) -> ModelEntry:
        with self._lock:
            entry = self._models.get(model_id)
        if entry is None:
            raise not_found(f"no training model {model_id!r} (closed, or never created here)")
        return entry

    def _lora_settings(self, lora: LoraRequest) -> LoraSettings:
        """peft's ``all-linear`` for attention and MLP (every linear layer but the head), else
        the module names; with ``train_unembed`` the names and ``lm_head``."""
        families = [ATTENTION_MODULES] * lora.train_attn + [MLP_MODULES] * lora.train_mlp
        if lora.train_unembed:
            targets = ",".join([*families, HEAD_MODULE])
        else:
            targets = "all-linear" if len(families) == 2 else families[0]
        return LoraSettings(rank=lora.rank, alpha=self.lora_alpha, target_modules=targets)

    def _info(self, entry: ModelEntry) -> ModelInfo:
        m = entry.model
        return ModelInfo(model_id=entry.model_id, base_model=entry.base_model,
                         tokenizer_dir=m.model_path, architecture=m.identity.architecture,
                         lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
                         target_modules=sorted({t.rsplit(".", 1)[-1] for t in m.target_modules}),
                         steps=m.steps,
                         policy_version=entry.version, pending_datums=m.pending_datums)

    def _describe(self, entry: ModelEntry) -> dict[str, Any]:
        m = entry.model
        return {"model_id": entry.model_id, "base_model": entry.base_model,
                "lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha,
                "target_modules": list(m.target_modules), "optimizer_steps": m.steps}
