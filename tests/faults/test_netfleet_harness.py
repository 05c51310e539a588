"""The network-namespace fleet harness itself (tests/netfleet.py): services reachable only
inside its namespaces, a silent cut and its restore, and nothing left behind on any exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import netfleet
import pytest
from netfleet import Fleet, fleet_namespaces, fleet_or_skip, unavailable_reason
from waiting import wait_for

TESTS = Path(__file__).resolve().parents[1]


def test_the_skip_reason_names_what_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netfleet._probe_machine() == ("network namespaces need root (run the tests as root, "
                                         "as CI does)")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netfleet.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    assert netfleet._probe_machine() == "`tc` (iproute2) is not installed"


def test_a_cut_link_drops_packets_silently_and_a_restored_one_carries_them(
        tmp_path: Path) -> None:
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master()
        host = fleet.host("master")
        assert host.address.startswith("10.") and master.address.startswith(host.address + ":")
        listing = ("gridrl-master", "nodes", "--master", master.address, "--timeout-s", "3")
        assert fleet.cli_json(*listing) == {"nodes": []}
        fleet.cut("master")
        out = fleet.cli(*listing)
        # no RST, no ICMP: the call runs into its deadline, it is not refused
        assert out.returncode == 1 and "DEADLINE_EXCEEDED" in out.stderr, out.stderr
        assert master.running()
        fleet.restore("master")
        assert wait_for(lambda: fleet.cli_json(*listing), 30, "the master to answer again")
        # the services' addresses exist in the fleet's namespaces only
        root_addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True,
                                        text=True).stdout
        assert f" {host.address}/" not in root_addresses
        fleet.set_profile("master", "slow")
        qdisc = subprocess.run(["tc", "-n", host.netns, "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 10Mbit" in qdisc, qdisc


def test_nothing_is_left_behind_after_a_failing_body(tmp_path: Path) -> None:
    if reason := unavailable_reason():
        pytest.skip(f"network fleet harness unavailable: {reason}")
    with pytest.raises(RuntimeError, match="the body failed"), Fleet(tmp_path) as fleet:
        tag = fleet.tag
        master = fleet.master()
        fleet.cut("master")
        assert len(fleet_namespaces(tag)) == 3  # switch, observer, master
        raise RuntimeError("the body failed")
    assert fleet_namespaces(tag) == []
    assert master.proc.poll() is not None


@pytest.mark.parametrize("how", ["exception", "sigterm"])
def test_nothing_is_left_behind_when_the_process_dies(tmp_path: Path, how: str) -> None:
    """A process that ends by an uncaught error (atexit) or SIGTERM (the handler) with a
    fleet open still tears it down."""
    if reason := unavailable_reason():
        pytest.skip(f"network fleet harness unavailable: {reason}")
    script = f"""
import json, sys, time
sys.path.insert(0, {str(TESTS)!r})
from netfleet import Fleet
fleet = Fleet(__import__("pathlib").Path({str(tmp_path)!r}))
master = fleet.master()
print(json.dumps({{"tag": fleet.tag, "pid": master.proc.pid}}), flush=True)
if {how!r} == "exception":
    raise SystemExit("body failed")
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    started = json.loads(proc.stdout.readline())
    if how == "sigterm":
        assert fleet_namespaces(started["tag"])
        proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert fleet_namespaces(started["tag"]) == []
    with pytest.raises(ProcessLookupError):
        os.kill(started["pid"], 0)
