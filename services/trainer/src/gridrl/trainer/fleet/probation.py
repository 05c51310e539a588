"""A flagged node's way back: benched, given the current adapter again, checked afresh.

    probation = Probation(pool, sync, check_kl=..., current_version=lambda: state.version,
                          bound=lambda node: 0.01, prompt=prompt_ids,
                          sampling=SamplingConfig(max_tokens=64), group_size=8)
    probation.start()
    probation.review("10.0.0.7:50051")   # the loop, when the monitor has flagged the node

When the monitor (``monitor.py``) flags a node for stale or mismatched samples (in the pool's
membership, the flag's one owner), the node is benched (no new groups) and the loop keeps
every sample of it that still arrives out of the update (``admission.py``). The ``probation``
thread then reviews it, at once and
again every ``interval_s`` (doubling after each failed check, up to ``max_interval_s``; a
node not checked yet because its push is pending is looked at again every ``poll_s``):

1. it waits until the trainer's current version is the newest one pushed (with
   ``--sync-every`` > 1 the nodes get the trainer's weights only at syncs);
2. it pushes that adapter to the node again (:meth:`AdapterSync.repush`: its weights are
   suspect, whatever it reports);
3. it samples one check group there (:meth:`NodePool.check_group`, the run's sampling
   settings, the first training prompt) and measures the mismatch KL of those samples against
   the trainer's own logprobs (``check_kl``, :func:`fresh_mismatch_kl`);
4. the node passes (:func:`gridrl.trainer.grpo.admission.readmission`) when every sample is of the
   current version and the KL is within its bound: it is unflagged in the pool (back in
   rotation; the monitor counts its bad steps afresh).

The review runs on its own thread so that it also brings back the only node of a run, while
the run waits for a node in rotation. ``on_review`` (the run's reporter: a console line) and
``gridrl_trainer_node_checks_total`` say what each check found (:class:`Review`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.fleet import metrics
from gridrl.trainer.fleet.backoff import Backoff
from gridrl.trainer.grpo import advantages as grpo
from gridrl.trainer.grpo.admission import readmission
from gridrl.trainer.grpo.sequences import TrainSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Review:
    """What one check of a flagged node found.

    Attributes:
        node: the node's address.
        passed: it was readmitted (back in rotation).
        message: what happened, in words (e.g. "stays benched" reasons, or "serves policy
            version 3 and passed a fresh mismatch check (...); back in rotation").
    """

    node: str
    passed: bool
    message: str


def fresh_mismatch_kl(backend: Any, prompt: Sequence[int], samples: Sequence[Any],
                      lock: Any | None = None) -> float | None:
    """Mean mismatch KL(behaviour || trainer) per token of ``samples`` of ``prompt``.

    The trainer's logprobs are the backend's teacher-forced scores under the current weights
    and the run's sampler transform (:meth:`gridrl.trainer.backends.base.TrainerBackend.logprobs`, the
    same comparison as the update's ``mismatch_kl``); the k3 estimate is
    :func:`gridrl.trainer.grpo.advantages.mismatch_kl`.

    Args:
        backend: the run's :class:`~gridrl.trainer.backends.base.TrainerBackend`.
        prompt: the prompt's token ids.
        samples: :class:`~gridrl.trainer.rollouts.RolloutSample` s (token_ids, logprobs).
        lock: held around the backend call (the loop holds it around its own backend calls:
            backend calls never overlap).
    Returns:
        nats per token (float64 accumulation), or None when no sample has a token.
    """
    seqs = [TrainSequence(prompt_ids=tuple(prompt), completion_ids=tuple(s.token_ids),
                          behaviour_logprobs=tuple(s.logprobs), advantage=0.0, group=0)
            for s in samples if s.token_ids]
    if not seqs:
        return None
    with lock if lock is not None else contextlib.nullcontext():
        trainer = backend.logprobs(seqs)
    return grpo.mismatch_kl(trainer, [s.behaviour_logprobs for s in seqs])


class Probation:
    """Reviews flagged nodes on a background thread (see the module docstring).

    Args:
        pool: the :class:`~gridrl.trainer.fleet.pool.NodePool`.
        sync: the :class:`~gridrl.trainer.fleet.sync.AdapterSync` (re-pushes).
        check_kl: ``check_kl(prompt, samples) -> KL or None`` under the trainer's current
            weights (:func:`fresh_mismatch_kl`).
        current_version: the trainer's policy version now.
        bound: the mismatch bound of a node (nats/token), by address.
        prompt: the prompt ids the check group samples.
        sampling: the run's sampling settings (max_tokens, temperature, top_p, top_k; its
            stop ids and top logprobs are not sent: the check group samples as the run's
            groups do).
        group_size: samples in the check group (the run's ``--group-size``), >= 1.
        on_review: called with each check's :class:`Review` (from the probation thread; it
            must return quickly), or None.
        interval_s: seconds between reviews of a node that failed one (doubling).
        max_interval_s: the longest interval.
        poll_s: seconds between reviews of a node that has not failed a check yet but could
            not be checked (its adapter not pushed yet, or unreachable): such a review is a
            look at the pool's state, no RPC, so the check follows the push within ``poll_s``.
    """

    def __init__(self, pool: Any, sync: Any, *,
                 check_kl: Callable[[Sequence[int], Sequence[Any]], float | None],
                 current_version: Callable[[], int], bound: Callable[[str], float],
                 prompt: Sequence[int], sampling: SamplingConfig, group_size: int,
                 on_review: Callable[[Review], None] | None = None,
                 interval_s: float = 5.0, max_interval_s: float = 60.0,
                 poll_s: float = 0.2) -> None:
        self.pool = pool
        self.sync = sync
        self._check_kl = check_kl
        self._current_version = current_version
        self._bound = bound
        self._prompt = list(prompt)
        self._sampling = sampling
        self._group_size = group_size
        self._on_review = on_review
        self.interval_s = interval_s
        self.max_interval_s = max_interval_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due: dict[str, float] = {}  # flagged node -> monotonic time of its next review
        self._failed: dict[str, int] = {}  # flagged node -> failed reviews
        self._last: dict[str, str] = {}  # flagged node -> why its last review kept it benched
        self._closed = False
        self._reviews = 0
        self._thread = threading.Thread(target=self._run, name="probation", daemon=True)

    def start(self) -> None:
        """Start the review thread; returns at once."""
        self._thread.start()

    def close(self) -> None:
        """Stop reviewing (a review in progress finishes). Idempotent."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def review(self, address: str) -> None:
        """Review the flagged node ``address`` at once, then until it is readmitted (the loop
        thread, when the monitor has flagged it)."""
        with self._lock:
            self._due[address] = 0.0
            self._failed[address] = 0
            self._last.pop(address, None)
            self._wake.notify_all()

    def pending(self) -> list[str]:
        """Nodes under review, sorted."""
        with self._lock:
            return sorted(self._due)

    def last_review(self, address: str) -> str | None:
        """Why the last review of ``address`` kept it benched (e.g. "waits for the trainer's
        policy version 2 to be pushed ..."); None before its first review or once it is back."""
        with self._lock:
            return self._last.get(address)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = [a for a, t in self._due.items() if t <= now]
                if not due:
                    wait = min(self._due.values(), default=now + 3600.0) - now
                    self._wake.wait(max(0.01, wait))
                    continue
            for address in due:
                try:
                    why, checked = self._review(address)
                except Exception as e:  # a review must never end the thread
                    log.exception("review of flagged node %s failed", address)
                    why, checked = f"review failed: {e!r}", True
                with self._lock:
                    if address not in self._due:
                        continue
                    if not why:
                        del self._due[address]
                        self._failed.pop(address, None)
                        self._last.pop(address, None)
                        continue
                    self._last[address] = why
                    n = self._failed.get(address, 0) + checked
                    self._failed[address] = n
                    delay = (min(self.poll_s, self.interval_s) if n == 0 else
                             Backoff(self.interval_s, self.max_interval_s).delay(n))
                    self._due[address] = time.monotonic() + delay

    def _review(self, address: str) -> tuple[str, bool]:
        """One review of a flagged node: ("", True) when it was readmitted, else (why not,
        whether the node was checked: a failed check backs the next review off, waiting for
        a push or a reachable node does not)."""
        state = self.pool.node(address)
        if state is None or not state.flagged:  # left the pool, or unflagged meanwhile
            with self._lock:
                self._due.pop(address, None)
                self._last.pop(address, None)
            return "", True
        if state.excluded or not state.healthy:
            return "unreachable", False
        version = self._current_version()
        pushed = self.sync.newest_version
        if pushed != version:
            return (f"waits for the trainer's policy version {version} to be pushed (newest "
                    f"pushed: {pushed})"), False
        return self._check(address, version, pushed), True

    def _check(self, address: str, version: int, pushed: int) -> str:
        """Re-push, sample the check group, measure; "" when readmitted."""
        if pushed:
            pushing = self.sync.repush(address)
            if not pushing.synced:
                return self._note(address, False, f"push of policy version {version} failed: "
                                                  f"{pushing.reason}")
        self._reviews += 1
        try:
            group = self.pool.check_group(address, self._prompt, self._sampling,
                                          group_size=self._group_size, seed=self._reviews)
        except (grpc.RpcError, KeyError, ValueError) as e:
            detail = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError)
                      else repr(e))
            return self._note(address, False, f"check group failed: {detail}")
        kl = self._check_kl(self._prompt, group.samples)
        why = readmission([s.policy_version for s in group.samples], version, kl,
                          self._bound(address))
        if why:
            return self._note(address, False, f"failed its fresh check: {why}")
        measured = f"KL {kl:.2e} nats/token at policy version {version}"
        # the review is reported before the node takes groups again: a batch that waited
        # for it must find the review already told
        self._note(address, True, f"serves policy version {version} and passed a fresh "
                                  f"mismatch check ({measured}); back in rotation")
        self.pool.unflag(address)
        return ""

    def _note(self, address: str, passed: bool, message: str) -> str:
        metrics.NODE_CHECKS.labels(address, "passed" if passed else "failed").inc()
        if passed:
            log.warning("flagged node %s %s", address, message)
        else:
            log.warning("flagged node %s stays benched: %s", address, message)
        if self._on_review is not None:
            self._on_review(Review(node=address, passed=passed, message=message))
        return "" if passed else message
