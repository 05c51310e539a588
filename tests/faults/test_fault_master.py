"""The master SIGKILLed under a running trainer and restarted on its port, with and without its
store: the trainer keeps training on the nodes it knows meanwhile, and the master hears from
every node again within one heartbeat interval of its return (the nodes retry every
``min(2 s, heartbeat interval)`` while it is away)."""

from __future__ import annotations

import signal

import pytest
from faultkit import (
    check_on_current_weights,
    check_steps_once,
    finish,
    healthy_at_master,
    heard_since,
    kill,
    port_of,
    records_after,
    step_records,
    wait_for,
)

pytestmark = pytest.mark.slow

HEARTBEAT_S = 3.0


@pytest.mark.parametrize("with_store", [True, False], ids=["with-store", "without-store"])
def test_master_killed_and_restarted(cluster, tmp_path, with_store) -> None:
    store = str(tmp_path / "master.sqlite") if with_store else ""
    master = cluster.master(store=store, heartbeat_s=HEARTBEAT_S)
    a = cluster.node("a", master=master.address)
    b = cluster.node("b", master=master.address)
    nodes = {a.address, b.address}
    wait_for(lambda: healthy_at_master(master.address) == nodes, 60, "both nodes registered")
    run_dir = tmp_path / "run"
    trainer = cluster.trainer("trainer", cluster.trainer_argv(run_dir, 500, master=master.address,
                                                              min_nodes=2))
    wait_for(records_after(run_dir, 1), 240, "step 2", alive=trainer)
    kill(master)
    killed_after = max(r["step"] for r in step_records(run_dir))

    # No master: the trainer trains on, on the nodes it knows, both kept in rotation.
    during = wait_for(records_after(run_dir, killed_after + 1, 2), 240,
                      "two steps without a master", alive=trainer)
    for r in during:
        assert set(r["nodes"]) <= nodes and r["nodes_synced"] == 2, r

    restarted = cluster.master("master-restarted", port=port_of(master), store=store,
                               heartbeat_s=HEARTBEAT_S)
    back_at = (tmp_path / "master-restarted.ready.json").stat().st_mtime  # serving from then
    seen = wait_for(lambda: (s := heard_since(restarted.address, back_at)).keys() == nodes
                    and s, 30, "the master to hear from both nodes")
    back_s = max(seen.values()) - back_at
    print(f"master restarted {'with' if with_store else 'without'} its store: both nodes heard "
          f"from after {back_s:.2f}s (heartbeat interval {HEARTBEAT_S}s)")
    assert back_s <= HEARTBEAT_S, f"nodes back after {back_s:.2f}s > one heartbeat"
    assert healthy_at_master(restarted.address) == nodes

    after = max(r["step"] for r in step_records(run_dir))
    wait_for(records_after(run_dir, after, 2), 240, "two steps after the return",
             alive=trainer)
    trainer.proc.send_signal(signal.SIGTERM)
    assert finish(trainer) == 143, trainer.log()[-4000:]
    records = step_records(run_dir)
    check_steps_once(records, records[-1]["step"])
    check_on_current_weights(records)
    assert all(r["nodes_synced"] == 2 for r in records)  # neither node was ever lost
