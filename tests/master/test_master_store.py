"""sqlite store: round trip, replace/delete, unreadable files and rows, default path."""

from __future__ import annotations

import sqlite3

from master_helpers import node_info

from gridrl.master.claims import Claim
from gridrl.master.store import SqliteStore, default_store_path
from gridrl.v1 import registry_pb2


def record(address: str, version: int = 0) -> registry_pb2.NodeRecord:
    r = registry_pb2.NodeRecord(node_id=f"id-{address}", info=node_info(address,
                                                                        adapter=("run", version)))
    r.last_seen.FromSeconds(1_700_000_000)
    return r


def test_round_trip_replace_delete(tmp_path) -> None:
    path = tmp_path / "sub" / "dir" / "master.sqlite"  # parent directories are created
    store = SqliteStore(path)
    store.put([record("a:1"), record("b:1")])
    store.put([record("a:1", version=5)])
    store.delete(["id-b:1", "id-unknown"])
    store.put([])
    store.delete([])
    store.close()
    reopened = SqliteStore(path)
    (only,) = reopened.load()
    assert only == record("a:1", version=5)
    reopened.close()


def test_unreadable_file_is_moved_aside(tmp_path) -> None:
    path = tmp_path / "master.sqlite"
    path.write_bytes(b"this is not an sqlite database, just some bytes" * 100)
    store = SqliteStore(path)
    assert store.load() == []
    store.put([record("a:1")])
    assert [r.info.address for r in store.load()] == ["a:1"]
    store.close()
    aside = [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("master.sqlite.corrupt-")


def test_a_version_1_store_is_upgraded_in_place_with_its_records(tmp_path) -> None:
    """Stores written before address claims existed keep their records and gain the claims
    table (they are not moved aside as unreadable)."""
    path = tmp_path / "master.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE nodes (node_id TEXT PRIMARY KEY, record BLOB NOT NULL)")
        conn.execute("INSERT INTO nodes VALUES (?, ?)", ("id-a:1",
                                                          record("a:1").SerializeToString()))
        conn.execute("PRAGMA user_version=1")
    store = SqliteStore(path)
    assert [r.info.address for r in store.load()] == ["a:1"] and store.load_claims() == []
    store.put_claim(Claim("n-1", "a:1", "node-a"))
    store.close()
    reopened = SqliteStore(path)
    assert reopened.load_claims() == [Claim("n-1", "a:1", "node-a")]
    reopened.close()
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2


def test_undecodable_row_is_skipped(tmp_path) -> None:
    path = tmp_path / "master.sqlite"
    store = SqliteStore(path)
    store.put([record("a:1")])
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO nodes VALUES (?, ?)", ("junk", b"\xff\xff\xff\xff"))
    assert [r.info.address for r in store.load()] == ["a:1"]
    store.close()


def test_default_path_follows_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_store_path() == str(tmp_path / "gridrl" / "master.sqlite")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_path() == str(tmp_path / "home" / ".local" / "state" / "gridrl"
                                       / "master.sqlite")
