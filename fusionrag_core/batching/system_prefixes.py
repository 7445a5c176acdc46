"""The system prefixes' K/V, computed once each and kept in memory.

A system prefix (the chat template's system turn) starts most prompts, and every chunk cache is
computed after one: its K/V are exact whoever asks, so they are computed once and shared by every
request and every ingest that starts with it. A prefix is kept per `Scope`: whether one was computed
before shows (as `cached_tokens`, and in time), so a system prompt one tenant sent is never served
as kept to another. Thread-safe; holds no per-request state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from fusionrag_core.query.prefill import prefill_prefix
from fusionrag_core.runtime.decoder import Decoder
from fusionrag_core.runtime.kv import ChunkKV
from fusionrag_core.scope import OPERATOR, Scope


class SystemPrefixes:
    """An LRU of computed system prefixes, keyed by their scope and token ids.

    Args:
        decoder: computes a prefix that is not kept yet.
        fingerprint: the model's, stamped on every prefix cache.
        size: how many distinct prefixes are kept (`EngineConfig.system_prefixes`).
    """

    def __init__(self, decoder: Decoder, fingerprint: str, size: int) -> None:
        self.decoder = decoder
        self.fingerprint = fingerprint
        self.size = size
        self._kept: OrderedDict[tuple[bytes, tuple[int, ...]], ChunkKV] = OrderedDict()
        self._lock = threading.Lock()  # NOTE: requests and ingest ask from several threads

    def get(self, prefix_ids: torch.Tensor, scope: Scope = OPERATOR) -> tuple[ChunkKV | None, bool]:
        """The exact cache of `prefix_ids` `[P]` (None when empty), and whether it was kept already
        for `scope` (False: computed by this call)."""
        if prefix_ids.numel() == 0:
            return None, False
        key = (scope.digest, tuple(int(t) for t in prefix_ids))
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key], True
        kv = prefill_prefix(self.decoder, prefix_ids, self.fingerprint)
        with self._lock:
            self._kept[key] = kv
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return kv, False


__all__ = ["SystemPrefixes"]
