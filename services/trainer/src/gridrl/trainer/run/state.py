"""What a checkpoint restores besides tensors: the step, the policy version and its lineage.

Policy versions: the trainer's weights after each update get a new version, never reused in the
run directory (``versions.jsonl``), and the *lineage* maps every version of the current
weights' history to the step that produced it. A sample's staleness is the trainer's step minus
the step of the sample's version; samples older than the bound, or of a version outside the
lineage (a killed run's last pushes, another run's adapter), are dropped
(:mod:`gridrl.trainer.grpo.admission`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """The run's bookkeeping, saved as a checkpoint's ``state.json``.

    Attributes:
        step: last finished step.
        version: the trainer's current policy version.
        lineage: version -> step whose weights it names, for every version of the current
            weights' history (version 0 = the base model = step 0).
        data_position: index of the next training prompt.
        baseline: eval score of the base model.
        elapsed_s: training seconds so far (model loading excluded).
        dropped_total: samples dropped for staleness so far.
        resumed_at: steps this run was resumed from.
    """

    step: int = 0
    version: int = 0
    lineage: dict[int, int] = field(default_factory=lambda: {0: 0})
    data_position: int = 0
    baseline: float | None = None
    elapsed_s: float = 0.0
    dropped_total: int = 0
    resumed_at: list[int] = field(default_factory=list)

    @property
    def next_version(self) -> int:
        """The version the next update's weights get (above every version of the lineage)."""
        return max(self.version, max(self.lineage)) + 1

    def adopt(self, version: int, step: int) -> None:
        """The weights after ``step`` are policy ``version`` from now on."""
        self.version = version
        self.lineage[version] = step

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version,
                "lineage": {str(k): v for k, v in sorted(self.lineage.items())},
                "data_position": self.data_position, "baseline": self.baseline,
                "elapsed_s": self.elapsed_s, "dropped_total": self.dropped_total,
                "resumed_at": self.resumed_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainerState:
        return cls(step=int(d["step"]), version=int(d["version"]),
                   lineage={int(k): int(v) for k, v in d["lineage"].items()},
                   data_position=int(d["data_position"]), baseline=d.get("baseline"),
                   elapsed_s=float(d.get("elapsed_s", 0.0)),
                   dropped_total=int(d.get("dropped_total", 0)),
                   resumed_at=list(d.get("resumed_at", [])))
