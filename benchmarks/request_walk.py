"""The walk of one request to its first token: which of our modules and functions it calls, on how
many threads, and how often it comes back to a module it already left.

Not a test and not a timing: a profiler hook (`sys.setprofile` + `threading.setprofile`, installed
before any thread of ours starts, so the server's thread, anyio's worker threads, the engine's
loader pool and loop thread all carry it) records every Python "call" event whose code lives under
`fusionrag_core/` or `fusionrag_integrations/` of the imported package, from the moment the request
is sent until the cut-off (below). Entry points (`--entries`, default all four):

    http          POST /v1/chat/completions, stream=false, to `create_app(session, ServerConfig())`
                  served by uvicorn on 127.0.0.1 in a thread (`tests.http_server.running_app`)
    http-stream   the same with stream=true (SSE)
    lc-invoke     `ChatFusionRAG(index=...).invoke([system, human], documents=docs)`
    lc-stream     the same through `.stream(...)`

Setup (not traced): a tiny random 2-layer Llama over the real SmolLM2 tokenizer (`--model
packaged` loads SmolLM2-135M-Instruct instead), a `FusionIndex` of short synthetic passages (one
chunk each), `ReuseSession(..., ReuseConfig(learn=False))` / `ChatFusionRAG(learn=False)`. Every
request, warm-up or measured, quotes two passages no earlier request quoted (the HTTP request
quotes their text, found by content; the LangChain request passes them as `documents=` with their
chunk ids), so no measured request is served by the prefix cache or an in-memory chunk cache of an
earlier one; `--warmup` untraced requests of the same entry point come first (steady state: lazy
imports done, thread pools and the system prefix made).

Cut-off: the first *return* from `fusionrag_core.query.decoding:Decoding.start` (the first token
picked from the prompt's last logits and its text decoded), on whatever thread; the calls made
inside it are counted, nothing after it. `--cutoff module:qualname` names another function (e.g.
after a rename); a run that never reaches it fails rather than reporting a partial walk.

What is counted (all from the recorded "call" events, in the global order the GIL gives them):
    modules       distinct modules (`fusionrag_core.query.decoding`), core and integrations apart
    functions     distinct `module:qualname` (`named` leaves out <genexpr> and <lambda>)
    calls         "call" events; a generator or coroutine resumed counts again (`resumes` of them)
    threads       distinct threads that ran our code (`kinds`: a pool's workers counted once, as
                  which loader worker takes a chunk varies from run to run); `switches`: how often
                  consecutive events of the global sequence are on different threads
    returns       the global sequence of events, consecutive equal modules merged: how many
                  times it enters a module it has been in before (A->B->A counts 1, A->B->C->B->A
                  counts 2) (`ret:calls`); `/thread`: the same on each thread's own sequence,
                  summed; `ret:fn-walk`: the same over each function's first call only, so loops
                  (layers, chunks) do not repeat a step and the count does not grow with the
                  model's depth; JSON `returns_first_entries`: all calls but generator resumes
    (list/dict/set comprehensions are left out of everything: frames of their own only before
    Python 3.12)

    PYTHONPATH=$PWD .venv/bin/python benchmarks/request_walk.py --out walk.json

The package is imported from the checkout this file is in (its directory's parent replaces it on
sys.path); the first line printed, and `origin` in the JSON, say which files and commit ran.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

# ---- the hook: installed at import, before any other import can start a thread --------------------------
_CODE_INFO: dict[CodeType, tuple[str, str, bool] | None] = {}
_EVENTS: list[tuple[int, CodeType, bool]] = []  # (thread ident, code, resumed)
_THREAD_NAMES: dict[int, str] = {}
_STATE: dict[str, Any] = {"active": False, "roots": (), "base": "", "cutoff": ("", ""), "cut_at": None,
                          "cut_thread": None}
_CUT = threading.Event()
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def _first_resume(code: CodeType) -> int:
    """The offset a generator's frame has on its first entry (its first RESUME); -1 if unknown."""
    import dis

    for instruction in dis.get_instructions(code):
        if instruction.opname == "RESUME":
            return instruction.offset
    return -1


def _info(code: CodeType) -> tuple[str, str, bool] | None:
    """(module, qualname, is a generator/coroutine) of a code object of ours, None for any other."""
    filename = code.co_filename
    for root in _STATE["roots"]:
        if filename.startswith(root):
            relative = filename[len(_STATE["base"]):]
            module = relative[:-3] if relative.endswith(".py") else relative
            module = module.replace("/", ".").removesuffix(".__init__")
            qualname = getattr(code, "co_qualname", code.co_name)
            return module, qualname, bool(code.co_flags & _GENERATOR_FLAGS)
    return None


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if not _STATE["active"]:
        return
    code = frame.f_code
    try:
        info = _CODE_INFO[code]
    except KeyError:
        info = _CODE_INFO[code] = _info(code)
        if info is not None and info[2]:
            _FIRST_RESUME[code] = _first_resume(code)
    if info is None:
        return
    if event == "call":
        ident = threading.get_ident()
        if ident not in _THREAD_NAMES:
            _THREAD_NAMES[ident] = threading.current_thread().name
        resumed = info[2] and frame.f_lasti > _FIRST_RESUME.get(code, -1) >= 0
        _EVENTS.append((ident, code, resumed))
    elif event == "return" and (info[0], info[1]) == _STATE["cutoff"]:
        _STATE["active"] = False
        _STATE["cut_at"] = time.perf_counter()
        _STATE["cut_thread"] = threading.current_thread().name
        _CUT.set()


_FIRST_RESUME: dict[CodeType, int] = {}
threading.setprofile(_profile)
sys.setprofile(_profile)
# NOTE: run as a file, Python puts benchmarks/ first on sys.path, where benchmarks/tests would hide the
# repository's tests package: the checkout this file is in takes its place (as `python -m` would).
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# ---- the rest: imports after the hook (they may start threads) ------------------------------------------
import argparse  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402

ENTRIES = ("http", "http-stream", "lc-invoke", "lc-stream")
PLACES = ["Gull Point", "Skerra", "Corran", "Marrow", "Tell Head", "Oster Bay", "Pell Rock", "Hawn Isle",
          "Brack Sound", "Lisk Cape", "Varden Reef", "Moll Harbour", "Quay End", "Sorrel Ness", "Thane Spit",
          "Wick Shoal", "Ebb Point", "Fenn Isle", "Grail Rock", "Ivel Bay"]
NAMES = ["Ada Vell", "Oren Tessaly", "Jon Pell", "Mira Kask", "Tomas Reeve", "Ilse Marn", "Per Olund",
         "Sana Quill", "Edda Rowe", "Bram Tulk", "Cleo Fenwick", "Dov Anker", "Hana Sorel", "Ivo Brandt",
         "Lena Osk", "Nils Harrow", "Rut Ember", "Ulf Garron", "Vera Lintz", "Yann Cole"]


def passages(count: int) -> list[str]:
    """`count` distinct one-chunk passages (each a few dozen tokens)."""
    texts = []
    for i in range(count):
        place, name = PLACES[i % len(PLACES)], NAMES[(7 * i + 3) % len(NAMES)]
        texts.append(f"The lighthouse on {place} was designed by the engineer {name} in {1850 + 3 * i}; its tower "
                     f"is {20 + i} metres tall and its lamp burns {3 + i % 5} wicks of whale oil.")
    return texts


def question(text: str) -> str:
    return f"Who designed the lighthouse on {text.split(' on ', 1)[1].split(' was ', 1)[0]}?"


# ---- recording ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def recording(cutoff: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """Record from entry to the cut-off; the yielded dict gets `start` (perf_counter) at entry."""
    _EVENTS.clear()
    _THREAD_NAMES.clear()
    _CUT.clear()
    _STATE.update(cut_at=None, cut_thread=None, cutoff=cutoff)
    mark: dict[str, Any] = {"start": time.perf_counter()}
    _STATE["active"] = True
    try:
        yield mark
    finally:
        _STATE["active"] = False


INLINED = ("<listcomp>", "<dictcomp>", "<setcomp>")
"""Comprehensions that are frames of their own up to Python 3.11 only (PEP 709 inlines them): left out."""
ANONYMOUS = ("<genexpr>", "<lambda>")


def _returns(sequence: Sequence[str]) -> tuple[int, list[str]]:
    """How often `sequence`, consecutive repeats merged, enters a module it was in before; the merged walk."""
    seen: set[str] = set()
    walk: list[str] = []
    count = 0
    for module in sequence:
        if walk and walk[-1] == module:
            continue
        if module in seen:
            count += 1
        seen.add(module)
        walk.append(module)
    return count, walk


def walk_metrics(events: Sequence[tuple[int, CodeType, bool]], names: dict[int, str]) -> dict[str, Any]:
    """The counts of the module docstring, from events in global time order."""
    infos: list[tuple[int, str, str, bool]] = []  # (thread ident, module, qualname, resumed)
    for ident, code, resumed in events:
        info = _CODE_INFO[code]
        assert info is not None  # NOTE: only our code is recorded
        if not info[1].endswith(INLINED):
            infos.append((ident, info[0], info[1], resumed))
    modules = sorted({module for _, module, _, _ in infos})
    functions = sorted({f"{module}:{qualname}" for _, module, qualname, _ in infos})
    named = [f for f in functions if not f.endswith(ANONYMOUS)]

    returns_global, global_walk = _returns([module for _, module, _, _ in infos])
    returns_first, _ = _returns([module for _, module, _, resumed in infos if not resumed])
    # the walk over each function's first call only: loops (layers, chunks, tokens) do not repeat it
    first_calls: list[tuple[int, str, str]] = []
    seen_functions: set[str] = set()
    for ident, module, qualname, _ in infos:
        if f"{module}:{qualname}" not in seen_functions:
            seen_functions.add(f"{module}:{qualname}")
            first_calls.append((ident, module, qualname))
    returns_functions, function_walk = _returns([module for _, module, _ in first_calls])
    thread_first: dict[int, list[str]] = {}
    for ident, module, _ in first_calls:
        thread_first.setdefault(ident, []).append(module)
    returns_functions_per_thread = sum(_returns(seq)[0] for seq in thread_first.values())
    threads: dict[int, list[str]] = {}
    for ident, module, _, _ in infos:
        threads.setdefault(ident, []).append(module)
    per_thread = {ident: _returns(seq)[0] for ident, seq in threads.items()}
    switches = sum(1 for a, b in itertools.pairwise(infos) if a[0] != b[0])
    # the walk over first calls with their threads, consecutive repeats merged: for reading
    walk_with_threads: list[list[str]] = []
    for ident, module, qualname, in first_calls:
        thread = names.get(ident, str(ident))
        if walk_with_threads and walk_with_threads[-1][:2] == [thread, module]:
            walk_with_threads[-1].append(qualname)
        else:
            walk_with_threads.append([thread, module, qualname])
    return {
        "modules": len(modules),
        "core_modules": sum(1 for m in modules if m.startswith("fusionrag_core")),
        "integration_modules": sum(1 for m in modules if m.startswith("fusionrag_integrations")),
        "functions": len(functions),
        "named_functions": len(named),
        "calls": len(infos),
        "resumes": sum(1 for _, _, _, resumed in infos if resumed),
        "threads": len(threads),
        # a pool's workers are one kind (fusionrag-load_0, fusionrag-load_1): which worker takes a load varies
        "thread_kinds": len({re.sub(r"[_-]?\d+$", "", names.get(ident, str(ident))) for ident in threads}),
        "thread_switches": switches,
        "returns_global": returns_global,
        "returns_per_thread": sum(per_thread.values()),
        "returns_first_entries": returns_first,
        "returns_function_walk": returns_functions,
        "returns_function_walk_per_thread": returns_functions_per_thread,
        "thread_detail": [{"thread": names.get(ident, str(ident)), "calls": len(seq),
                           "modules": sorted(set(seq)), "returns": per_thread[ident]}
                          for ident, seq in threads.items()],
        "module_list": modules,
        "function_list": functions,
        "module_walk": global_walk,
        "function_walk": function_walk,
        "first_calls_by_thread": walk_with_threads,
    }


def traced(entry: str, send: Callable[[], str], cutoff: tuple[str, str]) -> dict[str, Any]:
    """Run `send` (one request; returns its answer text) under the hook; the walk to the cut-off."""
    with recording(cutoff) as mark:
        answer = send()
    if _STATE["cut_at"] is None:
        raise RuntimeError(f"{entry}: the request ended without reaching the cut-off {cutoff[0]}:{cutoff[1]}; "
                           "pass --cutoff with the function that now picks the first token")
    events = list(_EVENTS)
    result = walk_metrics(events, dict(_THREAD_NAMES))
    result.update(entry=entry, answer=answer, cut_thread=_STATE["cut_thread"],
                  traced_ttft_s=round(_STATE["cut_at"] - mark["start"], 4))
    return result


# ---- entry points ---------------------------------------------------------------------------------------------
def rag_messages(texts: Sequence[str]) -> list[dict[str, str]]:
    context = "\n\n".join(texts)
    return [{"role": "user", "content": f"Answer from the context.\n\n{context}\n\nQuestion: {question(texts[0])}"}]


def http_sender(base_url: str, model: str, texts: Sequence[str], stream: bool, max_tokens: int) -> Callable[[], str]:
    import httpx

    body = {"model": model, "messages": rag_messages(texts), "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    url = f"{base_url}/v1/chat/completions"

    def send() -> str:
        if not stream:
            response = httpx.post(url, json=body, timeout=300)
            response.raise_for_status()
            return str(response.json()["choices"][0]["message"]["content"])
        pieces: list[str] = []
        with httpx.stream("POST", url, json=body, timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    pieces.append(choices[0].get("delta", {}).get("content") or "")
        return "".join(pieces)

    return send


def lc_sender(chat: Any, docs: Sequence[Any], stream: bool) -> Callable[[], str]:
    from langchain_core.messages import HumanMessage, SystemMessage

    messages = [SystemMessage("Answer from the passages."), HumanMessage(question(docs[0].page_content))]

    def send() -> str:
        if not stream:
            return str(chat.invoke(messages, documents=list(docs)).content)
        return "".join(str(chunk.content) for chunk in chat.stream(messages, documents=list(docs)))

    return send


# ---- setup ---------------------------------------------------------------------------------------------------
def code_origin() -> dict[str, Any]:
    """Where `fusionrag_core` was imported from, and that checkout's commit (and whether it is dirty)."""
    import fusionrag_core
    import fusionrag_integrations

    root = Path(fusionrag_core.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"fusionrag_core": fusionrag_core.__file__, "fusionrag_integrations": fusionrag_integrations.__file__,
            "root": str(root), "commit": git("rev-parse", "HEAD"),
            "dirty_files": [line for line in git("status", "--porcelain", "--untracked-files=no",
                                                  "--", "fusionrag_core", "fusionrag_integrations").splitlines()],
            "python": sys.version.split()[0]}


def build_engine(model: str, tokenizer_cache: Path) -> Any:
    import torch

    from fusionrag_core.engine import FusionEngine

    if model == "packaged":
        torch.manual_seed(0)
        return FusionEngine.from_pretrained(device="cpu", dtype=torch.float32)
    from transformers import AutoTokenizer

    from tests.ingest_worker import tiny_engine, tokenizer_dir

    return tiny_engine(AutoTokenizer.from_pretrained(tokenizer_dir(tokenizer_cache)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--entries", default=",".join(ENTRIES), help=f"comma-separated, of {', '.join(ENTRIES)}")
    parser.add_argument("--model", choices=("tiny", "packaged"), default="tiny")
    parser.add_argument("--tokenizer-cache", type=Path, default=Path(".pytest_cache/d/fusionrag-tokenizer"),
                        help="root of the saved SmolLM2 tokenizer (tests.ingest_worker.tokenizer_dir); "
                             "made from the .gguf (slow) if missing")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="untraced requests before each traced one")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--cutoff", default="fusionrag_core.query.decoding:Decoding.start",
                        help="module:qualname whose first return ends the walk")
    parser.add_argument("--out", type=Path, help="JSON file of the results")
    args = parser.parse_args(argv)
    entries = [e.strip() for e in args.entries.split(",") if e.strip()]
    unknown = set(entries) - set(ENTRIES)
    if unknown:
        parser.error(f"unknown entries {sorted(unknown)}; known: {', '.join(ENTRIES)}")
    module_name, _, qualname = args.cutoff.partition(":")
    cutoff = (module_name, qualname)

    import torch

    import fusionrag_core

    # NOTE: a code file is ours if it lies under the imported packages (a worktree's, with PYTHONPATH)
    package_root = Path(fusionrag_core.__file__).resolve().parents[1]
    _STATE["base"] = f"{package_root}{os.sep}"
    _STATE["roots"] = tuple(f"{package_root / name}{os.sep}" for name in ("fusionrag_core", "fusionrag_integrations"))
    origin = code_origin()
    print(f"fusionrag_core from {origin['fusionrag_core']} at {origin['commit'][:10] or '?'}"
          f"{' (dirty: ' + str(len(origin['dirty_files'])) + ' files)' if origin['dirty_files'] else ''}",
          flush=True)
    torch.set_num_threads(args.threads)

    from fusionrag_core.index import FusionIndex
    from fusionrag_core.ingest.config import IngestConfig
    from fusionrag_integrations.langchain import ChatFusionRAG
    from fusionrag_integrations.openai_server import ServerConfig, create_app
    from fusionrag_integrations.session import ReuseConfig, ReuseSession
    from tests.http_server import running_app

    per_request = 2
    texts = passages(len(entries) * (args.warmup + 1) * per_request)
    groups = iter([texts[i:i + per_request] for i in range(0, len(texts), per_request)])
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="request-walk-") as tmp:
        engine = build_engine(args.model, args.tokenizer_cache)
        index = FusionIndex.open(engine, Path(tmp) / "index", config=IngestConfig(chunk_tokens=64, neighbours=2))
        try:
            index.add_texts(texts)
            stored = index.collection.get(include=["documents"])
            chunk_of = dict(zip(stored["documents"] or [], stored["ids"], strict=True))
            missing = [t for t in texts if t not in chunk_of]
            if missing:
                raise RuntimeError(f"{len(missing)} passages were not stored as one chunk each")
            print(f"setup: {args.model} engine, {len(texts)} passages ingested in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            session = ReuseSession(engine, index.store, ReuseConfig(learn=False, data_dir=Path(tmp) / "data"))
            http_entries = [e for e in entries if e.startswith("http")]
            lc_entries = [e for e in entries if e.startswith("lc")]
            if http_entries:
                with running_app(create_app(session, ServerConfig())) as base_url:
                    for entry in http_entries:
                        stream = entry == "http-stream"
                        for _ in range(args.warmup):
                            http_sender(base_url, engine.name, next(groups), stream, args.max_tokens)()
                        send = http_sender(base_url, engine.name, next(groups), stream, args.max_tokens)
                        results.append(traced(entry, send, cutoff))
            if lc_entries:
                from langchain_core.documents import Document

                chat = ChatFusionRAG(index=index, max_tokens=args.max_tokens, temperature=0.0, learn=False,
                                     learned_dir=str(Path(tmp) / "learned"))
                for entry in lc_entries:
                    stream = entry == "lc-stream"

                    def documents(group: Sequence[str]) -> list[Any]:
                        return [Document(id=chunk_of[t], page_content=t) for t in group]

                    for _ in range(args.warmup):
                        lc_sender(chat, documents(next(groups)), stream)()
                    results.append(traced(entry, lc_sender(chat, documents(next(groups)), stream), cutoff))
        finally:
            index.close()

    header = (f"{'entry':<12} {'modules':>7} {'core':>5} {'integ':>5} {'functions':>9} {'named':>6} {'calls':>6} "
              f"{'threads':>7} {'kinds':>5} {'switches':>8} {'ret:calls':>9} {'/thread':>7} {'ret:fn-walk':>11} "
              f"{'/thread':>7}")
    print(f"\ncut-off: first return of {cutoff[0]}:{cutoff[1]}; code of {origin['root']} at {origin['commit'][:10]}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['entry']:<12} {r['modules']:>7} {r['core_modules']:>5} {r['integration_modules']:>5} "
              f"{r['functions']:>9} {r['named_functions']:>6} {r['calls']:>6} {r['threads']:>7} {r['thread_kinds']:>5} "
              f"{r['thread_switches']:>8} {r['returns_global']:>9} {r['returns_per_thread']:>7} "
              f"{r['returns_function_walk']:>11} {r['returns_function_walk_per_thread']:>7}")
    for r in results:
        threads = ", ".join(f"{t['thread']} ({t['calls']})" for t in r["thread_detail"])
        print(f"{r['entry']}: threads {threads}; cut on {r['cut_thread']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"origin": origin, "cutoff": args.cutoff, "model": args.model, "max_tokens": args.max_tokens,
                   "warmup": args.warmup, "torch_threads": args.threads, "entries": results}
        args.out.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
