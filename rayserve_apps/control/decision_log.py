"""The placement controller's decision log: one JSON line per decision, kept in Ray's GCS and exported as metrics.

Every decision (its inputs, the candidates and their predicted attainment, the diff applied, how long it took and
how it ended) is
- logged as one line `placement decision {json}` in the controller replica's log (Serve's logger: the log files
  and the dashboard's log view);
- appended to a bounded list in the GCS key-value store, so that a restarted controller (on any node) still
  answers `GET /v1/placement/history` with the decisions made before it;
- counted in `plexserve_controller_decisions_total{outcome}` with its predicted gain and duration as gauges.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from rayserve_apps import metrics

#: Serve's own logger: its lines land in the controller replica's log file (and the dashboard's log view).
logger = logging.getLogger("ray.serve")
#: Prefix of a decision's log line (grep for it; the rest of the line is JSON).
LOG_PREFIX = "placement decision "

#: Namespace and key of the decision list in Ray's GCS key-value store (one list per application).
KV_NAMESPACE = "plexserve"


def _kv_key(app_name: str) -> bytes:
    return f"placement-decisions/{app_name}".encode()


class DecisionLog:
    def __init__(self, app_name: str, history_size: int):
        self.app_name = app_name
        self.history_size = history_size
        self.entries: list[dict[str, Any]] = self._load()

    def _load(self) -> list[dict[str, Any]]:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        if not _internal_kv_initialized():
            return []
        raw = _internal_kv_get(_kv_key(self.app_name), namespace=KV_NAMESPACE)
        return json.loads(raw) if raw else []

    def _store(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

        if _internal_kv_initialized():
            _internal_kv_put(_kv_key(self.app_name), json.dumps(self.entries).encode(), overwrite=True,
                             namespace=KV_NAMESPACE)

    @property
    def next_id(self) -> int:
        return self.entries[-1]["id"] + 1 if self.entries else 0

    def record(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Append, persist, log and count one decision; returns it with its id."""
        entry = {"id": self.next_id, **entry}
        self.entries = [*self.entries, entry][-self.history_size:]
        self._store()
        logger.info(LOG_PREFIX + json.dumps(entry, sort_keys=True))
        outcome = entry.get("outcome", "unknown")
        metrics.controller_decisions_total().inc(tags={"outcome": outcome})
        metrics.controller_predicted_gain().set(float(entry.get("predicted_gain") or 0.0))
        metrics.controller_decision_seconds().set(float(entry.get("duration_s") or 0.0))
        return entry

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The most recent decisions, newest last."""
        return list(self.entries if limit is None else self.entries[-limit:])
