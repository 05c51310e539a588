"""The fuzz suite of ``tests/fuzz`` at length: the same strategies and properties
(``tests/fuzz/fuzzkit.py``) for ``--cases`` cases (default 10,000) over every RPC of the
master, the rollout node and the trainer, their raw request bytes, the PushAdapter stream and
the ``authorization`` metadata (a master that checks credentials);
then a table of how many cases ran per RPC and the status codes they got.

    python bench/fuzz.py [--cases 10000] [--seed 0]

Cases are split over the targets by weight (:data:`WEIGHTS`); a target whose strategy has few
distinct values (GetRunStatus, WatchRun) runs fewer cases than its share, since hypothesis
stops once it has tried them all, and the PushAdapter stream makes up the difference. Any property that fails stops the run with hypothesis's
shrunk example and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, table

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "fuzz")]

# Share of the cases per target (normalised).
WEIGHTS = {"Generate": 20, "ReloadAdapter": 6, "GetNodeInfo": 1, "RegisterNode": 8,
           "Heartbeat": 6, "ListNodes": 4, "WatchNodes": 4, "DeregisterNode": 4,
           "GetRunStatus": 1, "WatchRun": 1, "raw bytes": 10, "PushAdapter stream": 35,
           "authorization": 4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000, help="cases in all")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    args = ap.parse_args()

    import fuzzkit
    import grpc
    import torch
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    from gridrl.models.testing import make_tiny_llama
    from gridrl.v1 import rollout_pb2

    torch.set_num_threads(1)
    logging.getLogger("gridrl").setLevel(logging.ERROR)  # nodes expiring etc.: not findings
    work = Path(tempfile.mkdtemp(prefix="bench-fuzz-"))
    cluster = fuzzkit.Cluster(make_tiny_llama(work / "tiny-llama"), work)
    secured = fuzzkit.SecuredMaster(work)
    tally = fuzzkit.Tally()
    total_weight = sum(WEIGHTS.values())

    def run(target: str, strategy: st.SearchStrategy, case) -> float:
        n = max(1, round(args.cases * WEIGHTS[target] / total_weight))

        @seed(args.seed)
        @settings(max_examples=n, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def body(example) -> None:
            case(example)

        start = time.perf_counter()
        body()
        return time.perf_counter() - start

    def generate(request) -> None:
        answer, response = fuzzkit.answer_of(lambda: cluster.rollout.Generate(
            request, timeout=fuzzkit.DEADLINE_S))
        tally.add("Generate", answer)
        fuzzkit.check_answer(answer, rollout_pb2.GenerateRequest)
        cluster.generate_ok(answer, request, response)

    def reload(request) -> None:
        answer, _ = fuzzkit.answer_of(lambda: cluster.rollout.ReloadAdapter(
            request, timeout=fuzzkit.DEADLINE_S))
        tally.add("ReloadAdapter", answer)
        fuzzkit.check_answer(answer, rollout_pb2.ReloadAdapterRequest)

    def node_info(_) -> None:
        answer, _ = fuzzkit.answer_of(lambda: cluster.rollout.GetNodeInfo(
            rollout_pb2.GetNodeInfoRequest(), timeout=fuzzkit.DEADLINE_S))
        tally.add("GetNodeInfo", answer)
        assert answer.code == grpc.StatusCode.OK, answer

    def registry(rpc: str):
        def case(request) -> None:
            answer = fuzzkit.call_registry(cluster, rpc, request)
            tally.add(rpc, answer)
            fuzzkit.check_answer(answer, fuzzkit.RPCS[rpc])
        return case

    def trainer(rpc: str):
        def case(request) -> None:
            answer = fuzzkit.call_trainer(cluster, rpc, request)
            tally.add(rpc, answer)
            assert answer.code == grpc.StatusCode.OK, answer
        return case

    def raw(example) -> None:
        rpc, payload = example
        answer = fuzzkit.call_raw(cluster, rpc, payload)
        tally.add(f"{rpc} (raw bytes)", answer)
        fuzzkit.check_answer(answer, fuzzkit.RPCS.get(rpc, rollout_pb2.PushAdapterRequest),
                             fuzzkit.RAW_ROOTS | (fuzzkit.PUSH_ROOTS if rpc == "PushAdapter"
                                                  else frozenset()))

    def push(case) -> None:
        answer = fuzzkit.push_case(cluster, case)
        tally.add("PushAdapter (cancelled by the client)" if case.cut_after is not None
                  else "PushAdapter", answer)

    def auth(example) -> None:
        rpc, header = example
        answer = fuzzkit.call_with_auth(secured, rpc, header)
        tally.add(f"{rpc} (authorization metadata)", answer)
        fuzzkit.check_auth_answer(answer, rpc)

    registry_strategies = fuzzkit.registry_requests(lambda: cluster.node_ids)
    targets = [
        ("Generate", fuzzkit.generate_requests(cluster.vocab_size), generate),
        ("ReloadAdapter", fuzzkit.reload_requests(), reload),
        ("GetNodeInfo", st.just(None), node_info),
        *[(rpc, registry_strategies[rpc], registry(rpc)) for rpc in
          ("RegisterNode", "Heartbeat", "ListNodes", "WatchNodes", "DeregisterNode")],
        *[(rpc, fuzzkit.TRAINER_REQUESTS[rpc], trainer(rpc)) for rpc in
          ("GetRunStatus", "WatchRun")],
        ("raw bytes", st.tuples(st.sampled_from(sorted({*fuzzkit.RPCS, "PushAdapter"})),
                                fuzzkit.raw_bytes()), raw),
        ("PushAdapter stream", fuzzkit.push_cases(), push),
        ("authorization", st.tuples(st.sampled_from(["ListNodes", "RegisterNode"]),
                                    fuzzkit.auth_headers(secured.tokens)), auth),
    ]
    seconds = {}
    failed = None
    try:
        for target, strategy, case in targets:
            print(f"  {target} ...", flush=True)
            try:
                seconds[target] = run(target, strategy, case)
            except Exception as e:  # a property failed: hypothesis printed the example
                failed = f"{target}: {type(e).__name__}: {e}"
                break
        short = args.cases - tally.total()
        if failed is None and short > 0:  # small strategy spaces ran out: top up on the stream
            print(f"  PushAdapter stream, {short} more ...", flush=True)
            args.seed += 1
            WEIGHTS["PushAdapter stream"] = short * total_weight / args.cases
            try:
                seconds["top-up"] = run("PushAdapter stream", fuzzkit.push_cases(), push)
            except Exception as e:
                failed = f"PushAdapter stream: {type(e).__name__}: {e}"
            args.seed -= 1
        fuzzkit.wait_idle(cluster)
    finally:
        secured.close()
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)

    codes = sorted({c for counter in tally.codes.values() for c in counter})
    rows = [[rpc, str(sum(counter.values())), *[str(counter.get(c, "")) for c in codes]]
            for rpc, counter in sorted(tally.codes.items())]
    rows.append(["total", str(tally.total()),
                 *[str(sum(counter.get(c, 0) for counter in tally.codes.values()))
                   for c in codes]])
    print(f"\nbench/fuzz.py --cases {args.cases} --seed {args.seed}: master, torch node "
          "(tiny random llama), trainer status server; in-process, loopback")
    print(f"machine: {machine()}")
    print(table(rows, ["RPC", "cases", *codes]))
    print(f"{tally.total()} cases in {sum(seconds.values()):.0f} s; "
          + ("every property held" if failed is None else f"FAILED: {failed}"))
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
