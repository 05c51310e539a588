"""Who samples a policy version: :class:`SampleRouter`. The rollout nodes when they serve it
(:class:`~gridrl.trainer.primitives.fleet.FleetRoute`; prompt logprobs are the trainer's), else
the trainer on its own copy of the weights
(:class:`~gridrl.trainer.primitives.local_sampling.TrainerSampler`, decoded on the primitives'
model thread): an open training model's live weights, one of its snapshots swapped in, or a
model loaded for the snapshots of closed ones and for bare base models. The model table it
reads is :class:`~gridrl.trainer.primitives.service.PrimitivesService`'s.

Threads: the nodes' samples run on the ``primitives-sample`` threads and never wait for the
model thread; ``_lock`` guards the loaded sampler models (held for microseconds).
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

from gridrl.common.errors import StatusError, invalid_argument, not_found
from gridrl.trainer.backends.base import LoraSettings
from gridrl.trainer.primitives.fleet import FleetRoute
from gridrl.trainer.primitives.local_sampling import (
    LocalSample,
    SampleTarget,
    TrainerSampler,
    apply_stops,
)
from gridrl.trainer.primitives.model import ModelEntry, TrainableModel
from gridrl.trainer.primitives.snapshots import KEEP_UNNAMED, lora_targets
from gridrl.trainer.primitives.types import SampledSequence, SampleResult, SamplingSpec

log = logging.getLogger(__name__)

# (base model, LoRA settings, seed) -> a loaded model with a fresh adapter
ModelLoader = Callable[[str, LoraSettings, int], TrainableModel]


class SampleRouter:
    """Samples of a :class:`SampleTarget`, on the nodes or on the trainer.

    Args:
        fleet: the rollout nodes, or None (the trainer samples everything).
        load_model: loads a base model with a fresh adapter (for snapshots of closed models
            and bare base models).
        seed: seed of those adapters' initialisation (their B is zero or replaced).
        open_model: the service's entry of an open training model (None: not open).
        open_models: every open model's entry.
        submit: runs a job on the model thread (a future; failed when shutting down).
    """

    def __init__(self, *, fleet: FleetRoute | None, load_model: ModelLoader, seed: int,
                 open_model: Callable[[str], ModelEntry | None],
                 open_models: Callable[[], list[ModelEntry]],
                 submit: Callable[[Callable[[], Any]], futures.Future]) -> None:
        self.fleet = fleet
        self.seed = seed
        self._load_model = load_model
        self._open_model = open_model
        self._open_models = open_models
        self._submit = submit
        self._lock = threading.Lock()
        self._samplers: dict[tuple[str, Any], TrainableModel] = {}  # models of closed ones
        self._trainer_sampler = TrainerSampler(self._sampler_for)
        self._sample_threads = futures.ThreadPoolExecutor(16, thread_name_prefix="primitives-sample")

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
            drained = self._submit(self._trainer_sampler.drain)
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

        entry = self._open_model(target.model_id) if target.model_id else None
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

        for entry in self._open_models():
            if entry.base_model == base_model:
                return entry.model.tokenizer
        return AutoTokenizer.from_pretrained(resolve_model(base_model, progress=False))

    def close(self) -> list[TrainableModel]:
        """Finish the nodes' samples; the models it loaded (the caller closes them)."""
        self._sample_threads.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            models = list(self._samplers.values())
            self._samplers.clear()
        return models
