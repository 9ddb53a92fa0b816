"""Prefix-aware routing for the engine deployment (Ray Serve's request router interface).

A TinyLoop engine keeps the KV pages of prompt prefixes it has computed, and a later request
whose prompt starts with the same tokens at the same loops takes them instead of computing them
again. :class:`PrefixRouter` sends such a request to the replica that ran the prefix last:

* Each request's :attr:`Job.route_text <tinyloop_py.serve.api.Job.route_text>` (its loops and
  prompt) is cut into blocks of ``block_chars`` characters and hashed cumulatively, so hash i
  names the first i blocks. A table (least recently used first out, at most ``table_size``
  entries) maps each hash to the replica the last request with that prefix went to.
* A new request takes the replica of its longest known prefix when that prefix holds at least
  ``min_match_chars`` characters, the replica is live, and its queue (Serve's count of the
  requests it is running or holding) exceeds the shortest queue of the others by at most
  ``max_imbalance``. Otherwise, and when that replica turns out to be full, the request goes
  by power of two choices: the shorter queue of two random replicas.

Each caller (each ingress replica) keeps its own table; the table is a hint, so a stale entry
costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import collections
import random
from typing import Any, List, Optional

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)


def prefix_hashes(text: str, block_chars: int) -> List[int]:
    """Hash i (from 0) names ``text[: (i + 1) * block_chars]``; a last partial block is left
    out."""
    out, h = [], 0
    for i in range(len(text) // block_chars):
        h = hash((h, text[i * block_chars : (i + 1) * block_chars]))
        out.append(h)
    return out


class PrefixRouter(RequestRouter):
    """Routes by longest cached prompt prefix, falling back to power of two choices."""

    def initialize_state(
        self,
        block_chars: int = 16,
        min_match_chars: int = 64,
        max_imbalance: int = 8,
        table_size: int = 100_000,
    ) -> None:
        self._block_chars = block_chars
        self._min_blocks = max(1, -(-min_match_chars // block_chars))
        self._max_imbalance = max_imbalance
        self._table_size = table_size
        self._table: "collections.OrderedDict[int, ReplicaID]" = collections.OrderedDict()

    def _hashes(self, pending: Optional[PendingRequest]) -> List[int]:
        if pending is None or not pending.args:
            return []
        text = getattr(pending.args[0], "route_text", None)
        return prefix_hashes(text, self._block_chars) if isinstance(text, str) else []

    def _queue_len(self, replica: RunningReplica) -> int:
        n = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if n is None else n

    def _two_choices(self, candidates: List[RunningReplica]) -> List[RunningReplica]:
        return random.sample(candidates, min(2, len(candidates)))

    def _prefix_replica(
        self, hashes: List[int], candidates: List[RunningReplica]
    ) -> Optional[RunningReplica]:
        live = {r.replica_id: r for r in candidates}
        for i in range(len(hashes) - 1, self._min_blocks - 2, -1):
            replica_id = self._table.get(hashes[i])
            if replica_id is None:
                continue
            replica = live.get(replica_id)
            if replica is None:
                del self._table[hashes[i]]  # the replica is gone
                continue
            others = [self._queue_len(r) for r in candidates if r is not replica]
            if others and self._queue_len(replica) - min(others) > self._max_imbalance:
                return None
            return replica
        return None

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        fallback = self._two_choices(candidate_replicas)
        hashes = self._hashes(pending_request)
        replica = self._prefix_replica(hashes, candidate_replicas) if hashes else None
        if replica is None:
            return [fallback]
        # When the prefix's replica is full, the second rank takes the request.
        return [[replica], fallback]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hashes = self._hashes(pending_request)
        for h in hashes:
            self._table[h] = replica_id
            self._table.move_to_end(h)
        while len(self._table) > self._table_size:
            self._table.popitem(last=False)
