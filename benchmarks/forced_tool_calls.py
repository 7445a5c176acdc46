"""Forced tool calls with the packaged model: how often they parse, in process and over HTTP.

The LangChain RAG agent's first step forces a call of its retrieval tool (`retrieve_context(query:
str)`, the tutorial's). A small model tends to repeat itself inside the free-text `query` until
`max_tokens` (issue 45, item 7: 3 of 3 calls ran on at 256 tokens); string arguments are now
bounded under the call grammar (`EngineConfig.tool_string_chars`). For each prompt, the forced
call is decoded greedily:

* in process, unbounded (`max_string_chars` of 10^9: the grammar as it was) and bounded (the
  engine's default), through `ReuseSession.answer` and `split_calls`;
* over HTTP, bounded, against a real server (`create_app` under uvicorn on loopback, in a thread
  of this process, over the same session) with the OpenAI client.

A call parses when it is a `ToolCall` of the bound tool whose arguments are valid under its schema;
the results give, per prompt and mode, whether it parsed, the finish reason, the tokens and seconds,
and the query's length. Run it alone (one torch thread: the figures are its own):

    python benchmarks/forced_tool_calls.py --out benchmarks/results/forced-tool-calls
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import torch

from fusionrag_core.engine import FusionEngine, Generation
from fusionrag_core.query.tools import ToolCall, split_calls, tool_request
from fusionrag_integrations.openai_server import ServerConfig, create_app
from fusionrag_integrations.request import RequestOptions
from fusionrag_integrations.session import ReuseConfig, ReuseSession

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import serving  # NOTE: the load test's uvicorn-in-a-thread, not a copy

SYSTEM = "You have access to a tool that retrieves context from a blog post. Use the tool to help answer user queries."
TOOL: Any = {"type": "function", "function": {
    "name": "retrieve_context", "description": "Retrieve information to help answer a query.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
FORCE: Any = {"type": "function", "function": {"name": "retrieve_context"}}
QUESTIONS = [
    "Who built the Orvel Bridge?",
    "What is task decomposition?",
    "When was the Lumen lighthouse designed, and by whom?",
    "What are the common extensions of chain-of-thought prompting?",
    "Which river does the Orvel Bridge cross?",
    "How does an agent use memory to plan?",
    "What did Ada Vell's father do for a living?",
    "Summarise the blog post's section on tool use.",
]
UNBOUNDED = 10**9


def parses(call: Any) -> bool:
    """Whether `call` is a call of the tool with arguments valid under its schema."""
    if not isinstance(call, ToolCall) or call.name != "retrieve_context":
        return False
    try:
        jsonschema.validate(call.arguments, TOOL["function"]["parameters"])
    except jsonschema.ValidationError:
        return False
    return True


def in_process(session: ReuseSession, question: str, max_tokens: int, bound: int) -> dict[str, Any]:
    tools = tool_request([TOOL], FORCE, None)
    options = RequestOptions.from_values({"max_new_tokens": max_tokens, "temperature": 0.0}, tools=tools)
    engine = session.engine
    engine.config = replace(engine.config, tool_string_chars=bound)  # NOTE: one engine, two bounds in turn
    started = time.perf_counter()
    pieces = list(split_calls(session.answer(messages(question), options), engine.tool_format, tools))
    seconds = time.perf_counter() - started
    generation = next(p for p in pieces if isinstance(p, Generation))
    calls = [p for p in pieces if not isinstance(p, str | Generation)]
    call = calls[0] if calls else None
    query = call.arguments.get("query", "") if isinstance(call, ToolCall) else ""
    return {"parsed": parses(call), "finish_reason": generation.finish_reason, "tokens": len(generation.token_ids),
            "seconds": round(seconds, 2), "query_chars": len(query), "query": query[:120]}


def over_http(client: openai.OpenAI, model: str, question: str, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    chat: Any = messages(question)  # NOTE: Any: the openai package types messages as TypedDicts
    response = client.chat.completions.create(model=model, messages=chat, tools=[TOOL],
                                              tool_choice=FORCE, max_tokens=max_tokens, temperature=0)
    seconds = time.perf_counter() - started
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    parsed, query = False, ""
    if calls and calls[0].type == "function" and calls[0].function.name == "retrieve_context":
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(calls[0].function.arguments)
            query = str(arguments.get("query", "")) if isinstance(arguments, dict) else ""
            parsed = parses(ToolCall("retrieve_context", arguments, calls[0].id, ""))
    usage = response.usage
    return {"parsed": parsed, "finish_reason": choice.finish_reason,
            "tokens": usage.completion_tokens if usage else None,
            "seconds": round(seconds, 2), "query_chars": len(query), "query": query[:120],
            "markup_in_content": "<tool_call>" in (choice.message.content or "")}


def messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"parsed": sum(r["parsed"] for r in rows), "of": len(rows),
            "finish_reasons": {f: sum(r["finish_reason"] == f for r in rows)
                               for f in sorted({r["finish_reason"] for r in rows})},
            "mean_tokens": round(sum(r["tokens"] or 0 for r in rows) / len(rows), 1),
            "total_seconds": round(sum(r["seconds"] for r in rows), 1)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help="how many of the questions to ask")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    engine = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32)
    default_bound = engine.config.tool_string_chars
    data = tempfile.TemporaryDirectory()
    session = ReuseSession(engine, None, ReuseConfig(learn=False, data_dir=Path(data.name)))
    questions = QUESTIONS[: args.prompts]
    modes: dict[str, list[dict[str, Any]]] = {"in_process_unbounded": [], "in_process_bounded": [], "http_bounded": []}
    for question in questions:
        modes["in_process_unbounded"].append(in_process(session, question, args.max_tokens, UNBOUNDED))
        modes["in_process_bounded"].append(in_process(session, question, args.max_tokens, default_bound))
    engine.config = replace(engine.config, tool_string_chars=default_bound)
    with serving(create_app(session, ServerConfig())) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) as client:
        for question in questions:
            modes["http_bounded"].append(over_http(client, engine.name, question, args.max_tokens))
    result = {
        "model": engine.name, "max_tokens": args.max_tokens, "threads": args.threads,
        "tool_string_chars": default_bound, "questions": questions,
        "summary": {mode: summary(rows) for mode, rows in modes.items()},
        "rows": modes, "wall_seconds": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
