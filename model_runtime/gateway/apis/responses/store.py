"""Stored responses of the Responses API: what ``previous_response_id`` continues from.

Each stored response keeps its answer (the response object ``GET /v1/responses/{id}``
returns), the conversation that led to it and its reply (chat messages, the instructions
apart: a continuation takes the new request's instructions, as OpenAI's API does), and
the runtime's ``finish_key``, the saved state at the end of the reply. Kept in SQLite in an
owner-only folder (0700, the file 0600) so that they survive a gateway restart; bounded in
count and bytes, oldest dropped first; older than the time to live, gone. A response
belongs to its tenant: another tenant asking for its id is told it does not exist.

SQLite's calls are short (one row); the routes run them on a thread all the same.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...settings import ResponsesSettings

__all__ = ["ResponseStore", "StoredResponse"]

DB_NAME = "responses.sqlite3"


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant: str
    model: str
    created: float
    body: dict[str, Any]  # the response object as answered
    messages: list[dict[str, Any]]  # the conversation with the reply (chat messages)
    finish_key: str
    prompt_tokens: int  # the request's prompt (what a continuation must find cached)
    state_tokens: int  # tokens of the state at finish_key (prompt and reply)


class ResponseStore:
    """The stored responses; thread-safe (one connection, one lock). Opened on first
    use, so a gateway that never serves the Responses API writes nothing."""

    def __init__(self, settings: ResponsesSettings) -> None:
        self.settings = settings
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self.evicted = 0  # dropped to keep within the bounds (counted in /metrics)

    @property
    def path(self) -> Path:
        return self.settings.folder / DB_NAME

    def _open(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        folder = self.settings.folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # a folder that existed keeps no wider mode
        path = self.path
        # Created owner-only before SQLite opens it (its umask would leave it readable).
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(path, 0o600)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=DELETE")  # no -wal/-shm files beside it
        db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, "
                   "tenant TEXT NOT NULL, model TEXT NOT NULL, created REAL NOT NULL, "
                   "size INTEGER NOT NULL, body TEXT NOT NULL, messages TEXT NOT NULL, "
                   "finish_key TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
                   "state_tokens INTEGER NOT NULL)")
        db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")
        self._db = db
        return db

    def put(self, item: StoredResponse) -> None:
        """Store ``item``, then drop the oldest until the bounds hold (an item larger
        than the byte bound alone is not kept at all)."""
        body = json.dumps(item.body, ensure_ascii=False)
        messages = json.dumps(item.messages, ensure_ascii=False)
        size = len(body.encode()) + len(messages.encode())
        with self._lock:
            db = self._open()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?,?,?,?,?,?,?,?,?,?)",
                           (item.id, item.tenant, item.model, item.created, size, body,
                            messages, item.finish_key, item.prompt_tokens,
                            item.state_tokens))
                self.evicted += self._evict(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _evict(self, db: sqlite3.Connection) -> int:
        dropped = db.execute("DELETE FROM responses WHERE created < ?",
                             (time.time() - self.settings.ttl_s,)).rowcount
        count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) "
                                  "FROM responses").fetchone()
        if count <= self.settings.max_count and total <= self.settings.max_bytes:
            return dropped
        doomed = []
        for rid, size in db.execute("SELECT id, size FROM responses ORDER BY created, "
                                    "rowid"):
            if count <= self.settings.max_count and total <= self.settings.max_bytes:
                break
            doomed.append((rid,))
            count -= 1
            total -= size
        db.executemany("DELETE FROM responses WHERE id = ?", doomed)
        return dropped + len(doomed)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response, or None: unknown, another tenant's, or expired."""
        with self._lock:
            row = self._open().execute(
                "SELECT id, tenant, model, created, body, messages, finish_key, "
                "prompt_tokens, state_tokens FROM responses WHERE id = ? AND tenant = ? "
                "AND created >= ?",
                (response_id, tenant, time.time() - self.settings.ttl_s)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], row[3], json.loads(row[4]),
                              json.loads(row[5]), row[6], row[7], row[8])

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._open().execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant)).rowcount > 0

    def count(self) -> int:
        with self._lock:
            return int(self._open().execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
