"""The benchmark's methods: which selector over which chunk caches, one row per method.

Light on purpose (no torch): the CLI lists these in `fusionrag bench --help` without loading
anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusionrag_core.runtime.kv import Variant

#: Method name of the quality/speed reference: every prompt token is prefilled from scratch.
FULL_ATTENTION = "full_attention"
#: Method name of the lower bound: independent chunk caches are stitched, nothing is recomputed.
FULL_REUSE = "full_reuse"


@dataclass(frozen=True)
class Method:
    """One way of answering a prompt.

    Attributes:
        name: name in results.json.
        selector: the engine's selector; None = full attention (plain prefill, no cache).
        variant: which ingest's caches it reuses: "independent" or "fused".
        recomputes: whether it runs at each recompute ratio (baselines run once, ratio None).
    """

    name: str
    selector: str | None
    variant: Variant | None
    recomputes: bool

    def describe(self) -> str:
        """`name (selector, variant caches)`, as `fusionrag bench --help` lists it."""
        if self.selector is None:
            return f"{self.name} (plain prefill)"
        return f"{self.name} ({self.selector}, {self.variant} caches)"


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(FULL_ATTENTION, None, None, False),
        Method(FULL_REUSE, "none", "independent", False),
        Method("cacheblend", "kv_deviation", "independent", True),
        Method("epic", "first_k", "independent", True),
        Method("query_guided", "query_guided", "independent", True),
        Method("fusionrag", "query_guided", "fused", True),
        Method("fusionrag_drift", "drift_aware", "fused", True),
        Method("random", "random", "independent", True),
    )
}
"""Every method the runner knows, by name; each selector is a name in `query.select.SELECTORS`."""

#: The paper's baselines, its FusionRAG (`fusionrag`: last-layer question attention) and the
#: engine's default selection on fused caches (`fusionrag_drift`; a test keeps the two in step).
DEFAULT_METHODS: tuple[str, ...] = (FULL_ATTENTION, FULL_REUSE, "cacheblend", "epic", "query_guided", "fusionrag",
                                    "fusionrag_drift")
DEFAULT_RATIOS: tuple[float, ...] = (0.05, 0.15, 0.3)

__all__ = ["DEFAULT_METHODS", "DEFAULT_RATIOS", "FULL_ATTENTION", "FULL_REUSE", "METHODS", "Method"]
