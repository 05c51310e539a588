"""The primitives behind both wires: :class:`PrimitivesService`.

It owns the training models (one :class:`~gridrl.trainer.primitives.model.TrainableModel`
each), their snapshots for sampling (policy versions 1, 2, ... on disk, see
:mod:`gridrl.trainer.primitives.paths`), and the choice of who samples a version: the rollout
nodes when they serve it (:class:`~gridrl.trainer.primitives.fleet.FleetRoute`), else the
trainer on its own copy of the weights.

Every method returns a ``concurrent.futures.Future`` at once. Work on a model's weights runs on
one thread, ``primitives-model``, in the order it was submitted (so a caller that submits in
its order gets that order; the HTTP facade releases a client's requests in its ``seq_id``
order first, :mod:`gridrl.trainer.primitives.ordering`). Samples the nodes serve run on the
``primitives-sample`` threads and never wait for the model thread; the samples the trainer
serves itself queue for the model thread
(:class:`~gridrl.trainer.primitives.local_sampling.TrainerSampler`: requests queued at once
for the same weights and settings share one batched decode). The saved checkpoints as
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
import random
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
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
from gridrl.trainer.primitives.local_sampling import (
    LocalSample,
    SampleTarget,
    TrainerSampler,
    apply_stops,
)
from gridrl.trainer.primitives.model import TrainableModel
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
    SampledSequence,
    SampleResult,
    SamplingSpec,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# (base model, LoRA settings, seed) -> a loaded model with a fresh adapter
ModelLoader = Callable[[str, LoraSettings, int], TrainableModel]
ATTENTION_MODULES = "q_proj,k_proj,v_proj,o_proj"
MLP_MODULES = "gate_proj,up_proj,down_proj"


@dataclass
class _Entry:
    model: TrainableModel
    model_id: str
    base_model: str
    base_files: dict[str, bytes]  # version 0: B = 0, the base model
    versions: dict[int, Path] = field(default_factory=dict)  # sampler directory per version
    unnamed: list[int] = field(default_factory=list)
    version: int = 0  # newest snapshot
    live: int | None = 0  # the version equal to the current weights; None: trained since


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
        self._models: dict[str, _Entry] = {}
        self._snapshots: dict[str, tuple[str, int]] = {}  # sampler uri -> (model id, version)
        self._samplers: dict[tuple[str, Any], TrainableModel] = {}  # models of closed ones
        self._trainer_sampler = TrainerSampler(self._sampler_for)
        self._model_thread = futures.ThreadPoolExecutor(1, thread_name_prefix="primitives-model")
        self._sample_threads = futures.ThreadPoolExecutor(16, thread_name_prefix="primitives-sample")
        self._closed = False

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
            entry = _Entry(model, mid, base, base_files=model.adapter_files())
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

    def _drop_old_unnamed(self, entry: _Entry, version: int) -> list[Path]:
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
        """``spec.n`` samples of ``prompt`` on ``target``'s weights: on the rollout nodes when
        they serve that version (and prompt logprobs are not asked), else on the trainer.
        ``topk_prompt`` > 0: also the top-k logprobs of every prompt position
        (:attr:`SampleResult.topk_prompt`)."""
        result: futures.Future[SampleResult] = futures.Future()
        try:
            spec.check()
            if not prompt:
                raise invalid_argument("prompt", "is empty")
            if topk_prompt < 0:
                raise invalid_argument("topk_prompt_logprobs", f"must be >= 0, got {topk_prompt}")
        except StatusError as e:
            result.set_exception(e)
            return result
        seed = spec.seed if spec.seed is not None else random.getrandbits(63)
        prompt = list(prompt)

        def local() -> None:
            self._trainer_sampler.enqueue(LocalSample(target, prompt, spec, seed, result,
                                                      prompt_logprobs, topk_prompt))
            drained = self._on_model_thread(self._trainer_sampler.drain)
            if drained.done() and drained.exception() is not None:  # shutting down
                result.set_exception(drained.exception())

        def remote() -> None:
            try:
                samples, node = self.fleet.sample(prompt, spec, seed)  # type: ignore[union-attr]
            except Exception as e:  # no node could serve it: the trainer can
                log.warning("sampling on the rollout nodes failed (%s); sampling on the "
                            "trainer", e)
                return local()
            if any(s.policy_version != target.version for s in samples):
                return local()  # the fleet moved to a newer version meanwhile
            seqs = [SampledSequence(s.token_ids, s.logprobs, s.finish_reason, s.policy_version)
                    for s in samples]
            try:
                if spec.stop_strings:
                    seqs = apply_stops(seqs, spec, self.tokenizer(target.base_model))
                result.set_result(SampleResult(seqs, node))
            except Exception as e:
                result.set_exception(e)

        if (self.fleet is not None and not prompt_logprobs and not topk_prompt
                and self._fleet_serves(target)):
            self._sample_threads.submit(remote)
        else:
            local()
        return result

    def _fleet_serves(self, target: SampleTarget) -> bool:
        from gridrl.models import resolve_model

        try:
            path = str(resolve_model(target.base_model, progress=False))
        except (OSError, ValueError):
            return False
        return self.fleet is not None and self.fleet.serves(
            target.model_id, target.version, path)

    def _sampler_for(self, target: SampleTarget
                     ) -> tuple[TrainableModel, Mapping[str, bytes] | None]:
        """The model to sample ``target`` on, and the adapter files to swap in for the call
        (None: its current weights are the target's)."""
        from gridrl.adapters import read_dir

        with self._lock:
            entry = self._models.get(target.model_id) if target.model_id else None
        if entry is not None:
            if target.version == entry.live:
                return entry.model, None
            if target.version == 0:
                return entry.model, entry.base_files
            directory = entry.versions.get(target.version)
            if directory is None:
                raise not_found(f"{target.model_id}: policy version {target.version} was "
                                f"dropped (unnamed snapshots are kept {KEEP_UNNAMED} deep)")
            return entry.model, read_dir(directory / "peft")
        if target.adapter_dir is None:
            if target.model_id is not None and target.version != 0:
                raise not_found(f"training model {target.model_id} is closed: sample its "
                                "snapshot by its tinker:// path instead")
            # the base model: any adapter with B = 0 will do
            return self._sampler_model(target.base_model, LoraSettings(rank=1)), None
        files = read_dir(target.adapter_dir)
        cfg = json.loads(files["adapter_config.json"])
        targets = cfg.get("target_modules") or []
        settings = LoraSettings(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                                target_modules=lora_targets(targets))
        return self._sampler_model(target.base_model, settings), files

    def _sampler_model(self, base_model: str, settings: LoraSettings) -> TrainableModel:
        key = (base_model, settings)
        with self._lock:
            model = self._samplers.get(key)
        if model is None:
            model = self._load_model(base_model, settings, self.seed)
            with self._lock:
                self._samplers[key] = model
        return model

    def tokenizer(self, base_model: str) -> Any:
        """The tokenizer of ``base_model`` (an open model's, else loaded from its directory)."""
        from transformers import AutoTokenizer

        from gridrl.models import resolve_model

        with self._lock:
            for entry in self._models.values():
                if entry.base_model == base_model:
                    return entry.model.tokenizer
        return AutoTokenizer.from_pretrained(resolve_model(base_model, progress=False))

    # ---------------------------------------------------------------- plumbing

    def close(self) -> None:
        """Finish queued work, release every model and the fleet. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sample_threads.shutdown(wait=True, cancel_futures=True)
        self._model_thread.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            models = [e.model for e in self._models.values()] + list(self._samplers.values())
            self._models.clear()
            self._samplers.clear()
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

    def _entry(self, model_id: str) -> _Entry:
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

    def _info(self, entry: _Entry) -> ModelInfo:
        m = entry.model
        return ModelInfo(model_id=entry.model_id, base_model=entry.base_model,
                         tokenizer_dir=m.model_path, architecture=m.identity.architecture,
                         lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
                         target_modules=sorted({t.rsplit(".", 1)[-1] for t in m.target_modules}),
                         steps=m.steps,
                         policy_version=entry.version, pending_datums=m.pending_datums)

    def _describe(self, entry: _Entry) -> dict[str, Any]:
        m = entry.model
        return {"model_id": entry.model_id, "base_model": entry.base_model,
                "lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha,
                "target_modules": list(m.target_modules), "optimizer_steps": m.steps}
