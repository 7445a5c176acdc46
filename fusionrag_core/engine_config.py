"""`EngineConfig`: an engine's defaults for every query, its scheduler and its caches."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusionrag_core.batching.heal import HealConfig
from fusionrag_core.batching.prefix_cache import PrefixCacheConfig
from fusionrag_core.batching.scheduler import SchedulerConfig
from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.query.prompt import DEFAULT_INSTRUCTION
from fusionrag_core.query.select import SelectConfig
from fusionrag_core.query.selectors import DEFAULT_SELECTOR
from fusionrag_core.query.tools import DEFAULT_STRING_CHARS
from fusionrag_core.runtime.kv import Variant
from fusionrag_core.runtime.memory import DEFAULT_IDLE_BYTES


@dataclass(frozen=True)
class EngineConfig:
    """Defaults of every query; each can be overridden per call.

    Attributes:
        selector: which chunk tokens to recompute: a name in `fusionrag_core.query.select.SELECTORS`
            (each selector's docstring says what it picks). The default, "drift_aware", is
            FusionRAG's query-guided selection with a 3/4-depth probe, no budget spent on tokens
            whose cache is already exact, and the question's attention weighted by each token's
            fusion drift (`fusionrag_core.query.drift`).
        select: ratio and selector knobs.
        cache_variant: which stored cache to prefer: "fused" (FusionRAG) or "independent".
        exact_first_chunk: with "fused", a chunk right after the system prefix that caches are
            computed after (the configured instruction's) reuses its independent cache when
            stored: there it is exactly what full attention computes, while its fused cache
            attended to neighbours that full attention does not see.
        instruction: system instruction of the canonical layout.
        system_prefixes: how many distinct system prefixes to keep computed in memory
            (`fusionrag_core.batching.system_prefixes`).
        load_workers: threads that load a request's chunk caches from the store concurrently.
        audit_rate: share of requests (evenly spread, in [0, 1]) that are also answered with full
            attention once their answer has streamed, off the critical path; the first-token KL
            and agreement land in `Generation.audit`, `stats()`, `FusionEngine.audit_summary()`
            and the `fusionrag_core.query.audit` log (see `fusionrag_core.query.audit`).
        compile_decode: `torch.compile` each layer's MLP for one-token passes (the decode step).
            Meant for GPUs: a one-token pass is bound by kernel launches there, and compiling
            with CUDA graphs ("reduce-overhead") replays a step's kernels without the launch
            overhead, as gpt-fast does. Off by default: on CPU a step is bound by reading the
            weights and K/V, and compiling does not pay. The first step of each engine pays the
            compilation.
        scheduler: how requests from several threads and event loops share the model, and the
            engine's one admission point (`fusionrag_core.batching.scheduler`): one loop takes
            arriving requests to their first token between decode steps and decodes every running
            request in one batched step. None: each request runs its own passes on its caller's
            thread (requests on several threads then contend for the cores).
        prefix_cache: keep every finished request's K/V (prompt and answer) so that a later prompt
            starting with the same tokens (the next turn of a conversation, an agent's next call)
            continues from it (`fusionrag_core.batching.prefix_cache`); its reused chunk tokens stay
            open to the new question's recompute. None: only the system prefix is memoised.
        packed_linears: on CPU, run the decoder's fp32 projections and vocabulary head (probe,
            recompute, prefills, decode steps) through oneDNN with weights packed once
            (`fusionrag_core.runtime.linear`), faster than torch's `F.linear` (MKL) on such
            few-row products. Costs a second copy of the layers' projection weights and of the
            head; off keeps `F.linear`. No effect on GPUs or non-fp32 weights.
        idle_kv_bytes: on CPU, how much memory of finished requests' K/V buffers is kept for the next
            requests' buffers (`fusionrag_core.runtime.memory`) instead of being handed back to the
            system, which makes each new buffer touch its pages afresh (slow on VMs whose host
            reclaims freed memory). 0: every buffer is allocated afresh. On GPUs torch's caching allocator does this.
        tool_string_chars: the longest string a tool call's argument may hold where the tool's
            schema sets no `maxLength` (`fusionrag_core.query.tools.DEFAULT_STRING_CHARS`, 200): a
            small model that repeats itself inside a free-text argument is made to close it, and its
            call with it, instead of running to `max_tokens`. A schema's own `maxLength` wins.
        heal: heal kept requests while the engine is idle (`fusionrag_core.batching.heal`): a kept
            FusionRAG turn's K/V are recomputed from its first inexact token on, in pieces, so a
            later turn continues exact K/V (full attention's) instead of approximate ones. Needs
            `prefix_cache` and `scheduler`. None: off (a kept turn stays as computed).
    """

    selector: str = DEFAULT_SELECTOR
    select: SelectConfig = field(default_factory=SelectConfig)
    cache_variant: Variant = "fused"
    exact_first_chunk: bool = True
    instruction: str = DEFAULT_INSTRUCTION
    system_prefixes: int = 8
    load_workers: int = 8
    audit_rate: float = 0.0
    compile_decode: bool = False
    packed_linears: bool = True
    idle_kv_bytes: int = DEFAULT_IDLE_BYTES
    scheduler: SchedulerConfig | None = field(default_factory=SchedulerConfig)
    prefix_cache: PrefixCacheConfig | None = field(default_factory=PrefixCacheConfig)
    tool_string_chars: int = DEFAULT_STRING_CHARS
    heal: HealConfig | None = None

    def __post_init__(self) -> None:
        if self.heal is not None and (self.prefix_cache is None or self.scheduler is None):
            missing = "prefix_cache" if self.prefix_cache is None else "scheduler"
            raise InvalidRequestError(f"EngineConfig.heal heals the prefix cache's entries while the scheduler is "
                                      f"idle: it needs a {missing} (set one, or heal=None)")
        if self.idle_kv_bytes < 0:
            raise InvalidRequestError(f"idle_kv_bytes must be >= 0, got {self.idle_kv_bytes}")
        if self.load_workers < 1:
            raise InvalidRequestError(f"load_workers must be >= 1, got {self.load_workers}")
        if self.tool_string_chars < 1:
            raise InvalidRequestError(f"tool_string_chars must be >= 1, got {self.tool_string_chars}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise InvalidRequestError(f"audit_rate must be in [0, 1], got {self.audit_rate}")


__all__ = ["EngineConfig"]
