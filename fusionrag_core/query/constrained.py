"""Grammar-constrained decoding: the answer is guaranteed to match a JSON schema (or a regex).

Built on llguidance (the engine behind Guidance and the structured output of llama.cpp, vLLM and
SGLang): a Rust matcher that computes each step's allowed-token mask from the grammar in tens of
microseconds with no ahead-of-time vocabulary compilation, as one small wheel with no
dependencies (xgrammar pulls triton; outlines-core compiles an index per schema up front;
lm-format-enforcer is pure Python and per-token slower). The constraint is one more logits
processor: it masks logits before sampling, so prefill, cache reuse and selective recompute are
exactly those of an unconstrained request.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor

from fusionrag_core.errors import InvalidRequestError

INSTALL_HINT = "pip install 'fusionrag[structured]' (llguidance)"
# NOTE: compact JSON (no free whitespace): fewer tokens, and a small model cannot wander off into
# endless blank lines inside an object.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # NOTE: a submodule the package does not import itself
    except ImportError as exc:  # pragma: no cover - the extra is installed in the project's venv
        raise InvalidRequestError(f"constrained decoding needs llguidance: {INSTALL_HINT}") from exc
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """An immutable constraint on the generated text (an llguidance grammar), shareable by requests.

    Attributes:
        source: the llguidance grammar (JSON text).
        description: what it constrains to, for messages.
    """

    source: str
    description: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Grammar:
        """JSON matching `schema` (a JSON Schema dict).

        Raises:
            InvalidRequestError: the schema uses something llguidance cannot compile.
        """
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(json.dumps(dict(schema)), defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"not a JSON schema: {exc}") from exc
        endless = endless_refs(schema)
        if endless is not None:
            # NOTE: llguidance compiles such a schema; its matcher then admits only EOS (a cycle of bare
            # $refs) or one more level forever (a required property that recurses): no answer is valid
            raise InvalidRequestError(
                f"the schema admits no finite JSON value: every value it allows contains itself again, through "
                f"$ref {', '.join(repr(r) for r in endless)}; give the recursion a way out (make the property "
                "optional, allow an empty array, or add an anyOf branch without it)")
        return cls._checked(source, f"JSON matching schema {schema.get('title', '')!s}".rstrip())

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (JSON mode)."""
        source = _llguidance().LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        return cls._checked(source, "a JSON object")

    @classmethod
    def lark(cls, source: str, description: str) -> Grammar:
        """Text matching the llguidance Lark grammar `source` (`%json {...}` embeds a JSON schema).

        Raises:
            InvalidRequestError: the grammar does not compile; the message holds llguidance's reason.
        """
        return cls._checked(source, description)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the regular expression `pattern` in full."""
        return cls._checked(_llguidance().LLMatcher.grammar_from_regex(pattern), f"text matching /{pattern}/")

    @classmethod
    def _checked(cls, source: str, description: str) -> Grammar:
        error = _llguidance().LLMatcher.validate_grammar(source)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"cannot constrain decoding to {description}: {error}")
        return cls(source, description)


class GrammarProcessor(LogitsProcessor):
    """Masks every token the grammar does not allow next; one per request (it holds parser state).

    `input_ids` holds the prompt and then every token picked so far: the tokens appended since
    the previous call are fed to the matcher before the next mask is computed.
    """

    def __init__(self, grammar: Grammar, tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int],
                 prompt_tokens: int) -> None:
        llg = _llguidance()
        self.grammar = grammar
        self.matcher = llg.LLMatcher(_ll_tokenizer(tokenizer, tuple(sorted(eos_ids))), grammar.source, log_level=0)
        self._raise_on_error()
        self.consumed = prompt_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`scores` `[1, V]` with disallowed tokens set to -inf."""
        new = [int(t) for t in input_ids[0, self.consumed:]]
        if new:
            self.matcher.consume_tokens(new)
            self.consumed += len(new)
            self._raise_on_error()
        mask = self.matcher.compute_bitmask()
        self._raise_on_error()  # NOTE: a matcher with no way on leaves only EOS unmasked: never an answer
        words = torch.frombuffer(bytearray(mask), dtype=torch.int32)  # [ceil(V'/32)]
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)  # NOTE: ids past the tokenizer's vocab: never
        n = min(allowed.numel(), bits.numel())
        allowed[:n] = bits.reshape(-1)[:n].bool()
        if not bool(allowed.any()):
            raise InvalidRequestError(f"the grammar ({self.grammar.description}) allows no next token")
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))  # type: ignore[return-value]

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return bool(self.matcher.is_accepting())

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise InvalidRequestError(f"constrained decoding failed ({self.grammar.description}): "
                                      f"{self.matcher.get_error()}")


_TOKENIZERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple[int, ...], Any]] = (
    weakref.WeakKeyDictionary()
)
_TOKENIZERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of `tokenizer`, built once per tokenizer (it takes ~1 s) and then shared."""
    with _TOKENIZERS_LOCK:
        per_eos = _TOKENIZERS.setdefault(tokenizer, {})
        if eos_ids not in per_eos:
            llg = _llguidance()
            try:
                per_eos[eos_ids] = llg.hf.from_tokenizer(tokenizer, eos_token=list(eos_ids) or None)
            except ValueError as exc:
                raise InvalidRequestError(f"constrained decoding needs a fast tokenizer: {exc}") from exc
        return per_eos[eos_ids]


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists properties and does
    not say (OpenAI's strict mode): a small model otherwise invents keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def endless_refs(schema: Any) -> list[str] | None:
    """None if some finite JSON value can satisfy `schema` as far as its recursion goes; else the
    local `$ref`s (at most three) that lead only into values containing themselves again.

    Each subschema is an AND of what it requires (its `$ref` target, `allOf` members, one `anyOf` /
    `oneOf` branch, one of its `type`s: an object's required properties, an array's `minItems` first
    items); the least set of subschemas that can end is propagated from the ones that end outright
    (a string, `{}`, a `const`), in time linear in the schema. Keywords that do not recurse are read
    as satisfiable here (llguidance refuses what it finds unsatisfiable itself).
    """
    graph = _EndGraph(schema)
    ends = graph.ending()
    if ends[0]:
        return None
    return [ref for ref, node in graph.refs if not ends[node]][:3] or ["?"]


class _EndGraph:
    """The AND/OR graph of `endless_refs`: node 0 is the root schema; each node lists the nodes it needs."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.any: list[bool] = []  # NOTE: True: one child suffices (OR); False: all are needed (AND)
        self.children: list[list[int]] = []
        self.refs: list[tuple[str, int]] = []  # ($ref, the node of its target)
        self._ids: dict[int, int] = {}
        self._pending: list[tuple[int, Any]] = []
        self._node_of(root)
        while self._pending:
            node, sub = self._pending.pop()
            self._expand(node, sub)

    def _new(self, any_of: bool, children: list[int]) -> int:
        self.any.append(any_of)
        self.children.append(children)
        return len(self.any) - 1

    def _node_of(self, sub: Any) -> int:
        if not isinstance(sub, Mapping):
            return self._new(sub is False, [])  # NOTE: `false` is an empty OR; `true` (or junk) an empty AND
        if id(sub) not in self._ids:
            self._ids[id(sub)] = self._new(False, [])
            self._pending.append((self._ids[id(sub)], sub))
        return self._ids[id(sub)]

    def _expand(self, node: int, sub: Mapping[str, Any]) -> None:
        needs = self.children[node]
        ref = sub.get("$ref")
        target = _local_target(self.root, ref) if isinstance(ref, str) else None
        if target is not None:
            needs.append(self._node_of(target[0]))
            self.refs.append((str(ref), needs[-1]))
        needs += [self._node_of(s) for s in _list(sub.get("allOf"))]
        for key in ("anyOf", "oneOf"):
            if isinstance(sub.get(key), list):
                needs.append(self._new(True, [self._node_of(s) for s in sub[key]]))
        types = sub.get("type")
        if "const" not in sub and "enum" not in sub and types is not None:
            needs.append(self._new(True, [self._type_node(sub, t) for t in _list(types) or [types]]))

    def _type_node(self, sub: Mapping[str, Any], kind: Any) -> int:
        if kind == "object":
            given = sub.get("properties")
            properties: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
            extra = sub.get("additionalProperties", True)
            return self._new(False, [self._node_of(properties.get(p, extra)) for p in _list(sub.get("required"))])
        if kind == "array":
            least = sub.get("minItems", 0)
            least = least if isinstance(least, int) else 0
            items = sub.get("items", True)
            prefix = _list(sub.get("prefixItems")) or (items if isinstance(items, list) else [])
            rest = sub.get("items", True) if not isinstance(items, list) else sub.get("additionalItems", True)
            needs = [self._node_of(s) for s in prefix[:least]]
            return self._new(False, needs + ([self._node_of(rest)] if least > len(prefix) else []))
        return self._new(False, [])

    def ending(self) -> list[bool]:
        """Which nodes some finite value satisfies (the least fixpoint, by propagation from the leaves)."""
        parents: list[list[int]] = [[] for _ in self.any]
        for node, children in enumerate(self.children):
            for child in children:
                parents[child].append(node)
        waiting = [len(c) for c in self.children]
        ends = [False] * len(self.any)
        ready = [n for n, c in enumerate(self.children) if not c and not self.any[n]]
        while ready:
            node = ready.pop()
            if ends[node]:
                continue
            ends[node] = True
            for parent in parents[node]:
                waiting[parent] -= 1
                if not ends[parent] and (self.any[parent] or waiting[parent] == 0):
                    ready.append(parent)
        return ends


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _local_target(root: Any, ref: str) -> tuple[Any] | None:
    """(the subschema `ref` points at,) for a local JSON pointer (`#`, `#/$defs/a`); None otherwise."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None  # NOTE: remote refs and anchors: llguidance resolves or refuses them
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return (node,)


__all__ = ["INSTALL_HINT", "Grammar", "GrammarProcessor", "closed_objects", "endless_refs"]
