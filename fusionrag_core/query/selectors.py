"""The registry of selectors: every selector's name and one-line description, the default first.

The one place names are declared. `query.select.SELECTORS` derives from it (the selector `name` is
the function `select_<name>` there); the CLI, the integrations and the docs list these names. It
imports nothing, so the CLI can print its help and answer usage errors before loading torch.
"""

from __future__ import annotations

DEFAULT_SELECTOR = "drift_aware"
"""The selector a request gets unless it names another (`EngineConfig.selector`)."""

SELECTOR_DESCRIPTIONS: dict[str, str] = {
    "drift_aware": "FusionRAG's default: the question's attention times each token's fusion drift, exact tokens "
                   "skipped.",
    "query_guided": "The paper's FusionRAG: the tokens the question attends to most at the last layer.",
    "kv_deviation": "CacheBlend: the tokens whose fresh keys at an early layer deviate most from their cached keys.",
    "first_k": "EPIC: the first k tokens of every chunk, where attention sinks form in isolation.",
    "random": "Uniformly random tokens across all chunks, seeded by `SelectConfig.seed`.",
    "none": "Full reuse: recompute nothing.",
    "all": "Full recompute of every chunk token (equals a plain prefill; the prefix stays cached).",
}
"""Selector name -> what it recomputes, in one line (its function's docstring says how)."""


def selector_help() -> str:
    """Every selector as `name — description`, separated by semicolons, for a command line's help."""
    return "; ".join(f"{name} — {doc.rstrip('.')}" for name, doc in SELECTOR_DESCRIPTIONS.items())


__all__ = ["DEFAULT_SELECTOR", "SELECTOR_DESCRIPTIONS", "selector_help"]
