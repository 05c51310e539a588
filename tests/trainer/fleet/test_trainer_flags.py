"""The loop makes a bad node impossible to miss: samples of a node that never gets new weights
are dropped and the node is flagged; a node that claims the trainer's version but samples with
other weights is flagged by the mismatch KL. Real trainer loop, tiny llama; the "bad node" is
the local sampler's groups re-labelled with the defect."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from gridrl.trainer.config import TrainConfig
from gridrl.trainer.local import LocalRollout
from gridrl.trainer.run.driver import train

BAD = "10.0.0.9:50051"


class DefectiveNode:
    """Odd-indexed groups come from a node with ``defect``: "stale" (always samples the base
    model, version 0) or "mismatched" (claims the current version, logprobs 0.5 nats lower)."""

    def __init__(self, backend, version, defect: str) -> None:
        self.local = LocalRollout(backend, version)
        self.defect = defect

    def sample_turns(self, requests, sampling):
        results = self.local.sample_turns(requests, sampling)
        for request, samples in zip(requests, results, strict=True):
            if request.group % 2 == 0:
                continue
            for s in samples:
                s.node = BAD
                if self.defect == "stale":
                    s.policy_version = 0
                else:
                    s.logprobs = [lp - 0.5 for lp in s.logprobs]
        return results

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("defect", "first_flag", "reason"), [
    ("stale", 3, "stale: 4/4 samples dropped"),  # stale from step 2, flagged after 2 steps
    ("mismatched", 2, "mismatched: KL(behaviour || trainer) 1.49e-01"),  # e^.5 - 1.5
])
def test_bad_node_is_dropped_and_flagged(tiny_llama_dir, tmp_path, defect, first_flag, reason):
    cfg = TrainConfig(model=str(tiny_llama_dir), steps=4, prompts_per_step=2, group_size=4,
                      max_tokens=6, eval_every=4, eval_tasks=2, checkpoint_every=4,
                      run_dir=str(tmp_path / "run"), rollout=["local"], flag_after=2,
                      lora_rank=4, lora_alpha=8).finalize()
    out = io.StringIO()
    summary = train(cfg, console=Console(file=out, width=300),
                    source=lambda p, v: DefectiveNode(p, v, defect)).summary
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    steps = {r["step"]: r for r in records if r.get("step")}
    assert sorted(steps) == [1, 2, 3, 4]
    for step, r in steps.items():
        assert r["nodes"]["local"]["dropped"] == 0
        flagged = step >= first_flag
        assert (BAD in r["flagged_nodes"]) == flagged, (step, r["flagged_nodes"])
        assert "local" not in r["flagged_nodes"]
        if defect == "stale":
            assert r["nodes"][BAD]["versions"] == [0]
            assert r["dropped_samples"] == (4 if step >= 2 else 0)
            assert r["samples_used"] == (4 if step >= 2 else 8)
        else:
            assert r["dropped_samples"] == 0
            assert r["nodes"][BAD]["fresh_mismatch_kl"] == pytest.approx(0.148721, rel=1e-3)
            assert r["nodes"]["local"]["fresh_mismatch_kl"] < 1e-6
    assert reason in steps[first_flag]["flagged_nodes"][BAD]
    assert f"NODE FLAGGED  {BAD} at step {first_flag}" in out.getvalue()
    assert summary.flagged_nodes[BAD].startswith(reason.split(":")[0])
