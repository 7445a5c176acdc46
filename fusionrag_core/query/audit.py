"""Live quality audits: a sampled share of requests is also answered with full attention, after
the answer has streamed, and the first-token KL and agreement are logged and aggregated.

Reuse trades exactness for speed; how much depends on the corpus, the prompts and the ratio, and
it drifts as the corpus changes. An operator sets `EngineConfig.audit_rate` (e.g. 0.01) and reads
`FusionEngine.audit_summary()` (or the `fusionrag_core.query.audit` log) to see that drift in
production. The audit runs after the last text piece is handed out, so it never delays the first
token nor the streamed answer; the request's `Generation.audit` carries its own result.

Thread safety: one `Auditor` is shared by every thread of an engine; it holds only aggregate
counters, behind a lock. Per-request results travel in the request's own `Generation`.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.divergence import first_token_agree, first_token_kl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditResult:
    """One audited request.

    Attributes:
        kl_first_token: KL(full attention || served) of the first generated token's distribution.
        first_token_agree: whether the served greedy first token equals full attention's.
        selector / ratio: how the request was served.
        seconds: the audit's own cost (the full-attention prefill), off the request's critical path.
    """

    kl_first_token: float
    first_token_agree: bool
    selector: str
    ratio: float | None
    seconds: float


def compare(reference_logits: torch.Tensor, served_logits: torch.Tensor, *, selector: str, ratio: float | None,
            seconds: float) -> AuditResult:
    """The audit of one request from full attention's and the served first-token logits `[V]`."""
    return AuditResult(first_token_kl(reference_logits, served_logits),
                       first_token_agree(reference_logits, served_logits), selector, ratio, seconds)


class Auditor:
    """Which requests to audit (an exact share, evenly spread) and the running totals; thread-safe.

    Args:
        rate: share of requests to audit, in [0, 1]; request n (from 0) is audited when
            `floor((n + 1) * rate) > floor(n * rate)`, so any window of requests holds its share.
    """

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise InvalidRequestError(f"audit_rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._lock = threading.Lock()
        self._requests = 0
        self._audited = 0
        self._kl_sum = 0.0
        self._kl_max = 0.0
        self._agreed = 0

    def should_audit(self) -> bool:
        """Count one request and say whether it is to be audited."""
        if self.rate == 0.0:
            return False
        with self._lock:
            n = self._requests
            self._requests += 1
        return math.floor((n + 1) * self.rate) > math.floor(n * self.rate)

    def record(self, result: AuditResult) -> None:
        """Add an audited request to the totals and log it."""
        with self._lock:
            self._audited += 1
            self._kl_sum += result.kl_first_token
            self._kl_max = max(self._kl_max, result.kl_first_token)
            self._agreed += int(result.first_token_agree)
        logger.info("audit: %s ratio=%s first-token KL vs full attention %.4f, first token %s (%.0f ms)",
                    result.selector, result.ratio, result.kl_first_token,
                    "agrees" if result.first_token_agree else "DIFFERS", 1000 * result.seconds)

    def summary(self) -> dict[str, Any]:
        """`{"audit_rate", "requests", "audited", "kl_first_token_mean", "kl_first_token_max",
        "first_token_agreement"}` over the engine's life (means None before the first audit)."""
        with self._lock:
            audited = self._audited
            return {
                "audit_rate": self.rate,
                "requests": self._requests,
                "audited": audited,
                "kl_first_token_mean": self._kl_sum / audited if audited else None,
                "kl_first_token_max": self._kl_max if audited else None,
                "first_token_agreement": self._agreed / audited if audited else None,
            }


__all__ = ["AuditResult", "Auditor", "compare"]
