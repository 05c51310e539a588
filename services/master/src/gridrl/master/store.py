"""sqlite persistence of the registry: one row per node, the NodeRecord as protobuf bytes; one
row per address claim (which node credential holds it, :mod:`gridrl.master.claims`); and one
row per training run the dashboard shows (:mod:`gridrl.master.runs`, bounded JSON).

The store is a cache that lets a restarted master know its nodes at once; losing it costs at
most one heartbeat interval (nodes get NOT_FOUND and register again). So a file that is not a
readable store is moved aside (``<path>.corrupt-<unix time>``) rather than stopping the master.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from gridrl.master.claims import Claim
from gridrl.v1 import registry_pb2

log = logging.getLogger(__name__)

# 2 added the claims table; a version-1 file is upgraded in place.
SCHEMA_VERSION = 2
# Values of --store that mean "no persistence".
NO_STORE = ("", ":memory:")


def default_store_path() -> str:
    """``$XDG_STATE_HOME/gridrl/master.sqlite``, else ``~/.local/state/gridrl/master.sqlite``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".local", "state")
    return os.path.join(state, "gridrl", "master.sqlite")


class SqliteStore:
    """Registry records in an sqlite file (WAL journal; safe to call from any thread).

    Args:
        path: the database file; its directory is created if missing.

    Raises:
        OSError / sqlite3.Error: when the file cannot be created or opened at all.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._conn = self._open()
        except sqlite3.OperationalError:  # cannot open (permissions, a directory, locked)
            raise
        except sqlite3.DatabaseError as e:  # not a database, or another schema
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.error("store %s is unreadable (%s); moved it to %s and starting empty",
                      self.path, e, aside)
            os.replace(self.path, aside)
            self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, 1, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, expected {SCHEMA_VERSION}")
            conn.execute("CREATE TABLE IF NOT EXISTS nodes ("
                         "node_id TEXT PRIMARY KEY, record BLOB NOT NULL)")
            conn.execute("CREATE TABLE IF NOT EXISTS claims (node_id TEXT PRIMARY KEY, "
                         "address TEXT NOT NULL, credential_id TEXT NOT NULL)")
            # the dashboard's runs (gridrl.master.runs), as JSON; a master without the
            # dashboard ignores the table, so the schema version stays
            conn.execute("CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, "
                         "run TEXT NOT NULL)")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError:
            conn.close()
            raise
        return conn

    def load(self) -> list[registry_pb2.NodeRecord]:
        """Every stored record; rows that do not parse are skipped with a warning."""
        with self._lock:
            rows = self._conn.execute("SELECT node_id, record FROM nodes").fetchall()
        records = []
        for node_id, blob in rows:
            record = registry_pb2.NodeRecord()
            try:
                record.ParseFromString(blob)
            except Exception as e:  # DecodeError; a corrupt row must not stop the master
                log.warning("skipping unreadable stored record %s: %s", node_id, e)
                continue
            records.append(record)
        return records

    def put(self, records: Iterable[registry_pb2.NodeRecord]) -> None:
        """Insert or replace ``records`` (keyed by ``node_id``) in one transaction."""
        rows = [(r.node_id, r.SerializeToString()) for r in records]
        if not rows:
            return
        with self._lock, self._conn:
            self._conn.executemany("INSERT OR REPLACE INTO nodes VALUES (?, ?)", rows)

    def delete(self, node_ids: Iterable[str]) -> None:
        """Delete the records of ``node_ids`` (unknown ids are ignored)."""
        rows = [(i,) for i in node_ids]
        if not rows:
            return
        with self._lock, self._conn:
            self._conn.executemany("DELETE FROM nodes WHERE node_id = ?", rows)

    def load_claims(self) -> list[Claim]:
        """Every stored address claim."""
        with self._lock:
            rows = self._conn.execute("SELECT node_id, address, credential_id FROM claims")\
                .fetchall()
        return [Claim(*row) for row in rows]

    def put_claim(self, claim: Claim) -> None:
        """Insert or replace the claim on ``claim.node_id``."""
        with self._lock, self._conn:
            self._conn.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?)",
                               (claim.node_id, claim.address, claim.credential_id))

    def load_runs(self) -> list[str]:
        """Every stored run (JSON text, :func:`gridrl.master.run_wire.run_json`)."""
        with self._lock:
            return [row[0] for row in self._conn.execute("SELECT run FROM runs").fetchall()]

    def put_runs(self, runs: Iterable[tuple[str, str]]) -> None:
        """Insert or replace runs, given as (run_id, JSON text), in one transaction."""
        with self._lock, self._conn:
            self._conn.executemany("INSERT OR REPLACE INTO runs VALUES (?, ?)", list(runs))

    def delete_runs(self, run_ids: Iterable[str]) -> None:
        """Delete the stored runs ``run_ids`` (unknown ids are ignored)."""
        with self._lock, self._conn:
            self._conn.executemany("DELETE FROM runs WHERE run_id = ?", [(i,) for i in run_ids])

    def close(self) -> None:
        """Close the database. Idempotent."""
        with self._lock:
            self._conn.close()
