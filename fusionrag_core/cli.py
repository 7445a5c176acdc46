"""The `fusionrag` command: demo, ingest, ask, verify, learned and bench.

    fusionrag demo                                  # sample corpus, FusionRAG vs full attention
    fusionrag ingest docs/ notes.md                 # chunk, cache (independent + fused), index
    fusionrag ask "Who designed the lighthouse?"    # stream an answer from the stored caches
    fusionrag verify --no-repair                    # Chroma <-> KV store consistency
    fusionrag bench --data musique_dev.jsonl        # every method, results.json/.md + plots

Global options (--db, --model, ...) may come before or after the subcommand. Errors the package
raises on purpose (FusionRAGError and its subclasses) print as one line on stderr, exit code 2.

NOTE: heavy modules (torch, transformers, chromadb) are imported inside the commands, so `--help`
and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fusionrag_core.bench.methods import DEFAULT_METHODS, DEFAULT_RATIOS, METHODS
from fusionrag_core.errors import FusionRAGError, InvalidRequestError
from fusionrag_core.paths import DEFAULT_COLLECTION, DEFAULT_DATA_DIR, chroma_dir
from fusionrag_core.query.selectors import DEFAULT_SELECTOR, selector_help

if TYPE_CHECKING:
    from fusionrag_core.engine import FusionEngine, Generation
    from fusionrag_core.index import FusionIndex
    from fusionrag_core.ingest.chroma import RetrievedChunk
    from fusionrag_core.ingest.config import IngestConfig

PROG = "fusionrag"
TEXT_SUFFIXES = (".txt", ".md", ".markdown")
PDF_SUFFIX = ".pdf"


@dataclass(frozen=True)
class EngineSpec:
    """Which model to load, as the global options name it."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None


EngineFactory = Callable[[EngineSpec], "FusionEngine"]
# A subcommand's handler: (parsed args, engine loader, the command line) -> exit code.
Handler = Callable[[argparse.Namespace, Callable[[], "FusionEngine"], Sequence[str]], int]
# Entry-point group through which other packages add subcommands (the demo lives in
# fusionrag_integrations: the core never imports the integrations).
COMMANDS_GROUP = "fusionrag.commands"


@dataclass(frozen=True)
class Command:
    """A `fusionrag` subcommand another package contributes through the `fusionrag.commands`
    entry-point group (`name = "package.module:COMMAND"`).

    Attributes:
        name / help / description / epilog: as `argparse` subparsers take them.
        add_arguments: adds the subcommand's own options (the global ones are added for it).
        run: the handler; it loads the engine only when it needs one.
    """

    name: str
    help: str
    description: str
    epilog: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Handler


def plugin_commands() -> list[Command]:
    """The subcommands registered in the `fusionrag.commands` entry-point group, by name.

    A command that cannot be loaded is left out with a warning on stderr (the others still work).
    """
    from importlib.metadata import entry_points

    found: dict[str, Command] = {}
    for point in entry_points(group=COMMANDS_GROUP):
        try:
            command = point.load()
        except Exception as e:  # NOTE: a broken plugin must not take the core commands down with it.
            print(f"{PROG}: warning: command {point.name!r} ({point.value}) could not be loaded: {e}", file=sys.stderr)
            continue
        if not isinstance(command, Command):
            print(f"{PROG}: warning: entry point {point.value} is not a fusionrag_core.cli.Command; ignored",
                  file=sys.stderr)
            continue
        found.setdefault(command.name, command)
    return [found[name] for name in sorted(found)]


def load_engine(spec: EngineSpec) -> FusionEngine:
    """The default engine factory: `FusionEngine.from_pretrained` with the spec's model, device, dtype."""
    from fusionrag_core.engine import FusionEngine

    return FusionEngine.from_pretrained(spec.model, device=spec.device, dtype=spec.dtype)


def main(
    argv: Sequence[str] | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    commands: Sequence[Command] | None = None,
) -> int:
    """Run the `fusionrag` command; returns the exit code.

    Args:
        argv: the arguments (default `sys.argv[1:]`).
        engine_factory: builds the engine from the global model options (tests pass a small model).
        commands: subcommands besides the core ones (default: `plugin_commands()`, e.g. `demo`).

    Returns:
        0 on success; 1 when `verify` finds problems it did not repair; 2 on a usage error, a
        FusionRAGError or a server lost mid-command (printed as one line on stderr); 130 when interrupted.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(commands)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # NOTE: --help (0) and usage errors (2) end here, as numbers.
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    factory = engine_factory or load_engine
    spec = EngineSpec(args.model, args.device, args.dtype)
    try:
        with contextlib.ExitStack() as opened:
            args.opened = opened  # NOTE: what the command opens (`open_index`) is closed when it ends.
            code: int = args.handler(args, lambda: factory(spec), args_list)
        return code
    except (FusionRAGError, OSError) as e:  # NOTE: OSError: unreadable files, a --db that cannot be written...
        _fail(e)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        outage = _server_outage(e, args)
        if outage is None:
            raise
        _fail(outage)
        return 2
    return 2


def _server_outage(error: Exception, args: argparse.Namespace) -> FusionRAGError | None:
    """A FusionRAGError saying what to do when `error` is the Chroma server going away mid-command
    (the client raises httpx's transport errors, not its own), else None."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - chromadb depends on httpx
        return None
    if not isinstance(error, httpx.TransportError):
        return None
    return FusionRAGError(
        f"lost the connection to the Chroma server at {args.chroma_url} ({type(error).__name__}: {error}); "
        "check that it is running (`chroma run --path DIR --port PORT`), then run the command again: "
        "an interrupted ingest resumes where it stopped"
    )


def _fail(error: BaseException) -> None:
    message = " ".join(str(error).split())
    print(f"{PROG}: error: {message}", file=sys.stderr)


# ---- parser ---------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`fusionrag bench: error: ... (see fusionrag bench --help)`), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ratio_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.05,0.15,0.3, got {text!r}"
        ) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every subcommand shares. On subcommands their default is SUPPRESS, so a value
    given after the subcommand overrides the main parser's, and an absent one leaves it alone."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("global options")
    group.add_argument("--db", default=default(DEFAULT_DATA_DIR), metavar="DIR",
                       help=f"data directory: chroma/ and kv/ live here (default: {DEFAULT_DATA_DIR})")
    group.add_argument("--collection", default=default(DEFAULT_COLLECTION), metavar="NAME",
                       help=f"Chroma collection, one corpus (default: {DEFAULT_COLLECTION})")
    group.add_argument("--model", default=default(None), metavar="M",
                       help='packaged alias ("smollm2-135m" default, "gemma3-270m"), a .gguf file or a model directory')
    group.add_argument("--device", default=default(None), help="cpu, cuda, cuda:1 ... (default: CUDA if available)")
    group.add_argument("--dtype", default=default(None),
                       help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    group.add_argument("--chroma-url", default=default(None), metavar="URL",
                       help="Chroma server, e.g. http://127.0.0.1:8000 (default: embedded database under --db)")
    group.add_argument("--redis-url", default=default(None), metavar="URL",
                       help="Redis KV store, e.g. redis://127.0.0.1:6379/0 (default: disk store under --db)")
    group.add_argument("--selector", default=default(None),
                       help=f"which chunk tokens to recompute: {selector_help()} (default: {DEFAULT_SELECTOR})")
    group.add_argument("--ratio", type=float, default=default(None),
                       help="fraction of reused chunk tokens to recompute (default: 0.15)")
    group.add_argument("-k", type=positive_int, default=default(4),
                       help="chunks to retrieve per question (default: 4)")
    group.add_argument("--wait", type=float, default=default(0.0), metavar="SECONDS",
                       help="ingest/delete/verify: wait this long for another writer of the corpus (default: 0, "
                            "fail at once; one writer per corpus)")


def build_parser(plugins: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    """The argument parser of `fusionrag` and its subcommands.

    Args:
        plugins: subcommands besides the core ones (default: `plugin_commands()`).
    """
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description="FusionRAG: RAG that reuses precomputed, fused chunk KV caches and recomputes only the "
                    "~15% of chunk tokens the question attends to most.",
        epilog=textwrap.dedent("""\
            examples:
              fusionrag demo                                 ingest the sample corpus, compare with full attention
              fusionrag ingest docs/ notes.md                folders and .txt/.md files (.pdf with pypdf)
              fusionrag ask "Who designed the lighthouse?"   stream an answer, then TTFT and reuse statistics
              fusionrag verify --no-repair                   check Chroma, the KV store and learned caches
              fusionrag learned --purge --tenant alice       remove one tenant's learned caches
              fusionrag bench --data musique_dev.jsonl --limit 10 --out bench/
              fusionrag --db /data/rag --model gemma3-270m ask "..."
            """),
        formatter_class=formatter,
    )
    _global_options(parser, suppress=False)
    shared = _Parser(add_help=False)
    _global_options(shared, suppress=True)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    for plugin in plugin_commands() if plugins is None else plugins:
        sub = commands.add_parser(plugin.name, parents=[shared], formatter_class=formatter, help=plugin.help,
                                  description=plugin.description, epilog=plugin.epilog)
        plugin.add_arguments(sub)
        sub.set_defaults(handler=plugin.run)

    ingest = commands.add_parser(
        "ingest", parents=[shared], formatter_class=formatter,
        help="add .txt/.md files or folders (and .pdf with pypdf) to the index",
        description="Chunk documents, precompute each chunk's independent and fused KV caches, and add the chunks "
                    "to Chroma. A file ingested again replaces its previous version; unchanged chunks are skipped.",
        epilog="examples:\n  fusionrag ingest docs/\n  fusionrag --db /data/rag ingest a.md b.txt --neighbours 5",
    )
    ingest.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (searched recursively)")
    ingest.add_argument("--chunk-tokens", type=positive_int, help="most model tokens per chunk (new index: 256)")
    ingest.add_argument("--chunk-overlap", type=int, help="tokens shared by consecutive chunks (new index: 0)")
    ingest.add_argument("--neighbours", type=int,
                        help="similar chunks each fused cache is prefilled after (new index: 10)")
    ingest.add_argument("--no-fuse", action="store_true", help="independent caches only (the CacheBlend/EPIC setting)")
    ingest.add_argument("--quiet", action="store_true", help="no progress bars")
    ingest.add_argument("--ray", metavar="local|ADDRESS",
                        help="run the prefills on Ray: 'local' starts a one-machine cluster, else a cluster address "
                             "(auto, HOST:PORT, ray://HOST:10001); needs pip install 'fusionrag[ray]' and a KV store "
                             "every node reaches (--redis-url, or a --db on a shared directory)")
    ingest.add_argument("--workers", type=positive_int, default=2, help="Ray actors, one model each (default: 2)")
    ingest.add_argument("--threads-per-worker", type=positive_int, default=1,
                        help="CPUs (torch threads) per Ray actor (default: 1)")
    ingest.add_argument("--sync", action="store_true",
                        help="also remove documents ingested from these folders/files that no longer exist there")
    ingest.add_argument("--strict", action="store_true",
                        help="fail on a file that would be skipped (empty, not UTF-8 text, an unreadable PDF, a PDF "
                             "without pypdf) instead of skipping it")
    ingest.add_argument("--no-space-check", action="store_true",
                        help="go on even when the projected caches do not fit the store's free space")
    ingest.set_defaults(handler=cmd_ingest)

    delete = commands.add_parser(
        "delete", parents=[shared], formatter_class=formatter,
        help="remove documents (their chunks and caches) from the index",
        description="Remove documents by id: for `fusionrag ingest`ed files the id is the file's path (given "
                    "relative or absolute). Chunks other documents share stay; chunks fused after removed ones "
                    "are re-fused.",
        epilog="examples:\n  fusionrag delete docs/old.md\n  fusionrag delete lamp birth",
    )
    delete.add_argument("doc_ids", nargs="+", metavar="DOC_ID", help="document ids or ingested file paths")
    delete.set_defaults(handler=cmd_delete)

    ask = commands.add_parser(
        "ask", parents=[shared], formatter_class=formatter,
        help="answer a question from the index, streaming, then print TTFT and reuse statistics",
        description="Retrieve the -k most similar chunks, reuse their stored caches (recomputing --ratio of their "
                    "tokens, chosen by --selector) and stream the answer.",
        epilog='examples:\n  fusionrag ask "Who designed the Lumen Lighthouse?"\n'
               '  fusionrag ask "..." -k 6 --ratio 0.3\n  fusionrag ask "..." --full-attention',
    )
    ask.add_argument("question", help="the question (quote it)")
    ask.add_argument("--max-tokens", type=positive_int, default=128, help="answer length limit (default: 128)")
    ask.add_argument("--full-attention", action="store_true",
                     help="answer with a plain prefill of the whole prompt instead (the baseline; reuses nothing)")
    ask.set_defaults(handler=cmd_ask)

    verify = commands.add_parser(
        "verify", parents=[shared], formatter_class=formatter,
        help="check that Chroma and the KV store agree, and repair what does not",
        description="Load every cache the collection needs and look for missing, corrupt, mismatched, orphan and "
                    "stale ones. Exit code 1 when problems remain (with --no-repair). It takes the corpus's "
                    "writer lock (see --wait); after an interrupted ingest it reports the index incomplete (exit 1).",
        epilog="examples:\n  fusionrag verify\n  fusionrag verify --no-repair",
    )
    verify.add_argument("--repair", action=argparse.BooleanOptionalAction, default=True,
                        help="recompute bad caches, delete orphans, re-fuse stale caches (default: --repair)")
    verify.set_defaults(handler=cmd_verify)

    learned = commands.add_parser(
        "learned", parents=[shared], formatter_class=formatter,
        help="list the caches learned from traffic, per model and tenant, or purge a tenant's",
        description="List the learned caches under --db (each model, tenant and cache_salt: a salt shows as a "
                    "digest), or remove every learned cache of one tenant. Purge while no server uses --db.",
        epilog="examples:\n  fusionrag learned\n  fusionrag learned --purge --tenant alice",
    )
    learned.add_argument("--tenant", default=None, help="list (or purge) this tenant's only")
    learned.add_argument("--purge", action="store_true", help="remove the learned caches of --tenant")
    learned.set_defaults(handler=cmd_learned)

    bench = commands.add_parser(
        "bench", parents=[shared], formatter_class=formatter,
        help="quality and TTFT of every method on a QA dataset: results.json, results.md, plots",
        description="Ingest the rows' passages (independent and fused caches; one corpus per row, or one shared "
                    "corpus with --corpus shared), ask each question over its passages in order (or over the "
                    "top -k retrieved with --context retrieved), and answer with every method (greedy, "
                    "interleaved per row). Writes "
                    "results.json, results.md, quality.png and ttft.png into --out.",
        epilog="examples:\n"
               "  fusionrag bench --data ../shared/datasets/musique_dev.jsonl --limit 20 --max-passage-tokens 200\n"
               "  fusionrag bench --data rows.jsonl --methods full_attention full_reuse fusionrag --ratios 0.15\n"
               "  fusionrag bench --data rows.jsonl --limit 20 --corpus shared --context retrieved -k 8\n"
               "  fusionrag --model gemma3-270m bench --data rows.jsonl --neighbours 5",
    )
    bench.add_argument("--data", required=True, metavar="FILE.jsonl",
                       help='rows of {"question", "answers", "passages": [{"title", "text"}]}')
    bench.add_argument("--methods", nargs="+", metavar="METHOD",
                       help=f"{', '.join(m.describe() for m in METHODS.values())} "
                            f"(default: {' '.join(DEFAULT_METHODS)}; full_attention always runs)")
    bench.add_argument("--ratios", type=_ratio_list, default=DEFAULT_RATIOS,
                       help=f"recompute ratios, comma-separated (default: {','.join(map(str, DEFAULT_RATIOS))})")
    bench.add_argument("--limit", type=positive_int, help="first N rows (default: all)")
    bench.add_argument("--skip", type=int, default=0, metavar="N",
                       help="skip the first N rows, e.g. --skip 10 --limit 5 runs rows 10-14 (default: 0)")
    bench.add_argument("--corpus", choices=("row", "shared"), default="row",
                       help="row: each row's passages are a corpus of their own (neighbours = the prompt's "
                            "passages); shared: every selected row's passages in one corpus, neighbours found "
                            "corpus-wide, as in a deployment (default: row)")
    bench.add_argument("--context", choices=("gold", "retrieved"), default="gold",
                       help="gold: each question over its own passages; retrieved: over the top -k chunks "
                            "retrieved from the shared corpus (needs --corpus shared; -k default 4) (default: gold)")
    bench.add_argument("--neighbours", type=int, default=10,
                       help="n of fused ingest, capped at passages-1 (default: 10)")
    bench.add_argument("--max-passage-tokens", type=positive_int, metavar="N",
                       help="cut each passage to its first N model tokens (default: whole passages)")
    bench.add_argument("--max-new-tokens", type=positive_int, default=32, help="answer length limit (default: 32)")
    bench.add_argument("--storage-dtype", choices=("float16", "bfloat16", "float32", "int8", "float8_e4m3fn"),
                       default="float16",
                       help="dtype of stored caches (default: float16)")
    bench.add_argument("--out", default="./bench-out", metavar="DIR",
                       help="output directory (default: ./bench-out)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(handler=cmd_bench)
    return parser


# ---- shared helpers -------------------------------------------------------------------------------
def where(args: argparse.Namespace) -> str:
    return f"collection {args.collection!r} of {args.chroma_url or args.db}"


def _require_index(args: argparse.Namespace) -> None:
    """Fail fast (before loading a model) when there is no index to read."""
    if args.chroma_url is None and not chroma_dir(args.db).is_dir():
        raise InvalidRequestError(
            f"no index in {args.db}: run `{PROG} ingest PATH...` (or `{PROG} demo`) first, or pass --db DIR"
        )


def open_index(args: argparse.Namespace, engine: FusionEngine, config: IngestConfig | None = None) -> FusionIndex:
    """The index the global options name; closed when the command ends (under `main`; other callers
    close it themselves)."""
    from fusionrag_core.index import FusionIndex

    index = FusionIndex.open(engine, Path(args.db).expanduser(), chroma_url=args.chroma_url, redis_url=args.redis_url,
                             collection_name=args.collection, config=config, writer_wait_s=args.wait)
    opened: contextlib.ExitStack | None = getattr(args, "opened", None)
    return index if opened is None else opened.enter_context(index)


def _source(chunk: RetrievedChunk) -> str:
    meta = chunk.metadata
    name = meta.get("source", meta.get("file_name", meta.get("doc_id", chunk.chunk_id)))
    return f"{name} #{meta['chunk_index']}" if "chunk_index" in meta else str(name)


def _stats_line(g: Generation) -> str:
    how = "full attention" if g.selector == "full_attention" else (
        g.selector if g.ratio is None else f"{g.selector} @ ratio {g.ratio:g}")
    return (
        f"TTFT {g.ttft_s:.3f} s (total {g.total_s:.2f} s) | {how} | prompt {g.prompt_tokens} tokens = "
        f"reused {g.reused_tokens} + recomputed {g.recomputed_tokens} ({100 * g.recomputed_fraction:.1f}%) + "
        f"prefilled {g.prefilled_tokens} + prefix cache {g.prefix_cached_tokens} | "
        f"KV loaded {g.kv_bytes_loaded / 1e6:.1f} MB | cache misses {len(g.cache_misses)}"
    )


# ---- ingest ---------------------------------------------------------------------------------------
def _pdf_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("pypdf") is not None


def document_path(path: Path) -> Path:
    """The name a file is indexed under: its absolute path as given, symlinks not followed (so the
    document of a link is the link's, and goes when the link goes), `.` and `..` collapsed unless
    that would name another file (`link/..` is the link target's parent)."""
    absolute = path.expanduser().absolute()
    normal = Path(os.path.normpath(absolute))
    if normal == absolute or (normal.exists() and absolute.exists() and os.path.samefile(normal, absolute)):
        return normal
    return absolute


def collect_files(paths: Sequence[str], *, strict: bool = False) -> list[Path]:
    """The documents named by `paths`: files as given, folders searched recursively for .txt/.md (and
    .pdf when pypdf is installed), sorted, each once, by their `document_path`.

    Raises:
        InvalidRequestError: a path does not exist, a file has an unsupported type, or nothing was found;
            with `strict`, a folder holds .pdf files and pypdf is missing.
    """
    found: list[Path] = []
    skipped_pdfs = 0
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            for f in _files_under(path, strict=strict):
                suffix = f.suffix.lower()
                if suffix == PDF_SUFFIX and not _pdf_available():
                    skipped_pdfs += 1
                elif suffix in (*TEXT_SUFFIXES, PDF_SUFFIX):
                    found.append(f)
        elif path.is_file():
            if path.suffix.lower() not in (*TEXT_SUFFIXES, PDF_SUFFIX):
                raise InvalidRequestError(
                    f"{path}: unsupported file type {path.suffix or '(none)'!r}; ingest .txt or .md files "
                    "(or .pdf with pypdf installed)"
                )
            found.append(path)
        else:
            raise InvalidRequestError(f"{path} does not exist; pass existing files or folders")
    if skipped_pdfs and strict:
        raise InvalidRequestError(f"{skipped_pdfs} .pdf file(s) found need pypdf: pip install pypdf, or leave out "
                                  "--strict to skip them")
    if skipped_pdfs:
        print(f"{PROG}: skipping {skipped_pdfs} .pdf file(s): pip install pypdf to ingest PDFs", file=sys.stderr)
    unique = list(dict.fromkeys(document_path(p) for p in found))
    if not unique:
        raise InvalidRequestError(f"no .txt or .md files found in {', '.join(paths)}")
    return unique


def _files_under(folder: Path, *, strict: bool) -> list[Path]:
    """The files under `folder`, recursively (links to folders not followed), sorted. A folder that
    cannot be listed (its permissions) is skipped with a line on stderr, or refused when `strict`."""
    unlisted: list[OSError] = []
    files = [Path(top) / name for top, _, names in os.walk(folder, onerror=unlisted.append) for name in names]
    for e in unlisted:
        if strict:
            raise InvalidRequestError(f"the folder {e.filename} cannot be listed ({e.strerror}); make it readable "
                                      "to this user, or leave out --strict to skip such folders")
        print(f"{PROG}: skipping the folder {e.filename}: {e.strerror}", file=sys.stderr)
    return sorted(f for f in files if f.is_file())


class UnreadableDocumentError(InvalidRequestError):
    """A document file whose text cannot be read: not UTF-8 text, a PDF pypdf cannot parse, or a file
    this process may not (or cannot) read.

    Attributes:
        kind: what is wrong, in a few words ("not UTF-8 text", "unreadable PDF", "not readable").
    """

    def __init__(self, path: Path, kind: str, detail: str, fix: str) -> None:
        super().__init__(f"{path}: {kind} ({detail}); {fix}")
        self.kind = kind


def read_document(path: Path) -> str:
    """The text of a .txt/.md (UTF-8) or .pdf file.

    Raises:
        UnreadableDocumentError: the file is not UTF-8 text, is a PDF pypdf fails on, or cannot be
            read (its permissions, an I/O error, gone since it was listed).
        InvalidRequestError: the file is a PDF and pypdf is missing.
    """
    try:
        if path.suffix.lower() == PDF_SUFFIX:
            return _pdf_text(path)
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableDocumentError(path, "not UTF-8 text", f"byte 0x{e.object[e.start]:02x} at offset {e.start}: "
                                      f"{e.reason}", "convert it to UTF-8 to ingest it") from e
    except OSError as e:
        raise UnreadableDocumentError(path, "not readable", e.strerror or str(e),
                                      "make it readable to this user (its permissions, its disk) to ingest it") from e


def read_documents(files: Sequence[Path], *, strict: bool = False) -> tuple[list[tuple[Path, str]], dict[str, int]]:
    """The text of each file; a file with no text, or unreadable (`UnreadableDocumentError`), is skipped
    with a line on stderr.

    Returns:
        `(path, text)` of the files read, and how many were skipped, by reason ("empty", "not UTF-8 text", ...).

    Raises:
        InvalidRequestError: `strict`, and a file would be skipped (it names the file and why).
    """
    docs: list[tuple[Path, str]] = []
    skipped: dict[str, int] = {}
    for path in files:
        try:
            text = read_document(path)
        except UnreadableDocumentError as e:
            if strict:
                raise InvalidRequestError(f"{e}, or leave out --strict to skip such files") from e
            print(f"{PROG}: skipping {e}", file=sys.stderr)
            skipped[e.kind] = skipped.get(e.kind, 0) + 1
            continue
        if text.strip():
            docs.append((path, text))
        elif strict:
            raise InvalidRequestError(f"{path}: no text; add text to it, or leave out --strict to skip such files")
        else:
            print(f"{PROG}: skipping {path}: no text", file=sys.stderr)
            skipped["empty"] = skipped.get("empty", 0) + 1
    return docs, skipped


def _skipped_note(skipped: Mapping[str, int]) -> str:
    if not skipped:
        return ""
    return f"; skipped {sum(skipped.values())} file(s) ({', '.join(f'{n} {why}' for why, n in skipped.items())})"


def _pdf_text(path: Path) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import PyPdfError
    except ImportError as e:
        raise InvalidRequestError(f"{path}: reading PDF files needs pypdf: pip install pypdf") from e
    try:
        reader = PdfReader(path)
        return "\n\n".join(page.extract_text() or "" for page in reader.pages)
    except PyPdfError as e:
        raise UnreadableDocumentError(path, "unreadable PDF", str(e), "export it as text and ingest that") from e


def _ingest_config(args: argparse.Namespace) -> IngestConfig | None:
    """The settings named on the command line, or None to use the collection's own (or the defaults)."""
    given: dict[str, Any] = {
        name: value
        for name, value in (("chunk_tokens", args.chunk_tokens), ("chunk_overlap", args.chunk_overlap),
                            ("neighbours", args.neighbours), ("fuse", False if args.no_fuse else None))
        if value is not None
    }
    if not given:
        return None
    from fusionrag_core.ingest.config import IngestConfig

    return IngestConfig(**given)


def cmd_ingest(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag ingest PATH...`."""
    docs, skipped = read_documents(collect_files(args.paths, strict=args.strict), strict=args.strict)
    if not docs:
        raise InvalidRequestError(f"no file given has text to ingest{_skipped_note(skipped)}")
    config = _ingest_config(args)
    index = open_index(args, engine(), config)
    ray = None
    if args.ray:
        from fusionrag_core.ingest.distributed import RayConfig

        # NOTE: each worker builds the driver's model with the same factory (Ray pickles it).
        ray = RayConfig(engine, address=args.ray, workers=args.workers, threads_per_worker=args.threads_per_worker)
    report = index.add_texts(
        [text for _, text in docs],
        metadatas=[{"source": str(path)} for path, _ in docs],
        # NOTE: the paths as named (`document_path`): ingesting a file again replaces it, and once that
        # name is gone (a removed link too), --sync removes it.
        doc_ids=[str(path) for path, _ in docs],
        progress=not args.quiet,
        ray=ray,
        space_check=not args.no_space_check,
    )
    print(
        f"ingested {len(docs)} document(s) into {where(args)}: {report.new_chunks} new chunk(s), "
        f"{report.skipped_chunks} already indexed, {report.re_fused_chunks} re-fused, {report.removed_chunks} removed, "
        f"in {report.seconds:.1f} s ({len(index)} chunks in the index){_skipped_note(skipped)}"
    )
    if args.sync:
        indexed, present = index.document_ids(), {str(path) for path, _ in docs}
        gone = sorted(gone_documents(indexed, args.paths, present))
        if gone:
            removed = index.delete(gone)
            print(f"--sync: removed {len(gone)} document(s) no longer there ({removed} chunk(s)): " + ", ".join(gone))
        aliases = resolved_aliases(indexed, present)
        if aliases:
            print(f"--sync: kept {len(aliases)} document(s) indexed under the resolved path of a file given here by "
                  f"another name (as earlier versions indexed files, or ingested directly): {', '.join(aliases)}; "
                  f"`{PROG} delete PATH...` removes such a copy")
    return 0


def gone_documents(indexed: set[str], paths: Sequence[str], present: set[str]) -> set[str]:
    """Indexed file documents under `paths` (folders, or files as given) that are not in `present` and
    whose file is gone. A path counts by its `document_path` and by its resolved path, under which
    earlier versions indexed files."""
    roots = {root for p in paths for root in (document_path(Path(p)), Path(p).expanduser().resolve())}
    out = set()
    for doc_id in indexed - present:
        doc = Path(doc_id)
        if doc.is_absolute() and any(doc == r or r in doc.parents for r in roots) and not doc.is_file():
            out.add(doc_id)
    return out


def resolved_aliases(indexed: set[str], present: set[str]) -> list[str]:
    """Indexed documents named by the resolved path of a file in `present` that is named otherwise
    (through a symlink): indexed so by an earlier version, or ingested directly; --sync keeps them."""
    aliases = {str(Path(doc_id).resolve()) for doc_id in present} - present
    return sorted(aliases & indexed)


# ---- delete ---------------------------------------------------------------------------------------
def cmd_delete(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag delete DOC_ID...`: 0 when every id named a document, 2 when none did."""
    _require_index(args)
    index = open_index(args, engine())
    # NOTE: a delete that died part-way names documents no chunk lists any more; deleting one finishes it.
    indexed = index.document_ids() | set(index.interrupted_deletes())
    wanted: list[str] = []
    unknown: list[str] = []
    for raw in args.doc_ids:
        # NOTE: files are indexed by `document_path`; earlier versions used the resolved path.
        names = (raw, str(document_path(Path(raw))), str(Path(raw).expanduser().resolve()))
        doc_id = next((name for name in names if name in indexed), None)
        (wanted if doc_id else unknown).append(doc_id or raw)
    if not wanted:
        raise InvalidRequestError(
            f"no document {', '.join(map(repr, unknown))} in {where(args)}; ids are what ingest used (for files: "
            "their path)"
        )
    removed = index.delete(wanted)
    print(f"deleted {len(wanted)} document(s) from {where(args)}: {removed} chunk(s) removed "
          f"({len(index)} chunks in the index)")
    if unknown:
        print(f"{PROG}: not in the index (skipped): {', '.join(unknown)}", file=sys.stderr)
    return 0


# ---- ask ------------------------------------------------------------------------------------------
def cmd_ask(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag ask QUESTION`: stream the answer, then statistics and sources."""
    from fusionrag_core.query.sampling import SamplingConfig

    if not args.question.strip():
        raise InvalidRequestError("the question is empty; pass it in quotes: fusionrag ask \"...\"")
    _require_index(args)
    index = open_index(args, engine())
    hits = index.search(args.question, args.k)
    if not hits:
        raise InvalidRequestError(f"{where(args)} holds no chunks; run `{PROG} ingest PATH...` first")
    prompt = index.prompt_for(args.question, hits)
    sampling = SamplingConfig(max_new_tokens=args.max_tokens)
    if args.full_attention:
        stream = index.engine.full_attention(prompt, sampling=sampling)
    else:
        stream = index.stream(prompt, sampling=sampling, selector=args.selector, ratio=args.ratio)
    for piece in stream:
        print(piece, end="", flush=True)
    assert stream.result is not None  # NOTE: set once the stream is exhausted.
    print("\n")
    print(_stats_line(stream.result))
    print("sources: " + "; ".join(f"[{i}] {_source(h)} (score {h.score:.2f})" for i, h in enumerate(hits, 1)))
    return 0


# ---- verify ---------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag verify`: the corpus, then the learned caches; 0 if consistent (or repaired), 1 if
    problems remain."""
    from fusionrag_core.reuse.inventory import learned_scopes

    scopes = learned_scopes(args.db)
    if args.chroma_url is None and not chroma_dir(args.db).is_dir() and scopes:
        print(f"no index in {args.db}: checking its learned caches only")
        return _verify_learned(args)
    status = _verify_index(args, engine)
    return max(status, _verify_learned(args)) if scopes else status


def _verify_learned(args: argparse.Namespace) -> int:
    """Check every directory of learned caches under --db (no model is loaded); 1 if problems remain."""
    from fusionrag_core.reuse.inventory import learned_scopes, verify_learned

    status = 0
    for scope in learned_scopes(args.db):
        report = verify_learned(scope, repair=args.repair)
        name = f"learned caches of tenant {scope.tenant!r}" if scope.tenant else "learned caches"
        if report.ok:
            print(f"{name} in {report.path}: {report.caches} OK")
            continue
        found = ", ".join(f"{len(ids)} {kind}" for kind, ids in (("missing", report.missing), ("corrupt",
                          report.corrupt), ("orphans", report.orphans)) if ids)
        print(f"{name} in {report.path}: found {found}; " + ("removed (they are learned again from traffic)"
                                                               if report.repaired else
                                                               f"not repaired; run `{PROG} verify --repair`"))
        status = status if report.repaired else 1
    return status


def _verify_index(args: argparse.Namespace, engine: Callable[[], FusionEngine]) -> int:
    """Check the corpus: Chroma and its KV store; 1 if problems remain."""
    _require_index(args)
    index = open_index(args, engine())
    report = index.verify(repair=args.repair)
    print(f"{where(args)}: {report.chunks} chunk(s) in Chroma, {report.blobs} with caches in {index.store!r}")
    if report.finished:
        print(f"finished the interrupted {report.finished}")
    if report.incomplete:
        print(f"INCOMPLETE: the last {report.incomplete}; the index lacks some of its documents, or still holds "
              f"parts of deleted ones. Re-run that command (it resumes where it stopped, reusing the caches it "
              f"stored; `{PROG} verify` with repair finishes a delete too), then `{PROG} verify`. Nothing was "
              "repaired.")
        return 1
    if report.drift_added:
        print(f"upgraded: {report.drift_added} fused cache(s) given their fusion drift (read by drift_aware)")
    elif report.without_drift:
        print(f"{report.without_drift} fused cache(s) carry no fusion drift (written by an earlier version); "
              f"`{PROG} verify --repair` adds it from the stored caches, no prefill")
    if report.ok:
        print("OK: every chunk has its caches, and every cache its chunk")
        return 0
    problems = {name: getattr(report, name) for name in ("missing", "corrupt", "mismatched", "orphans", "textless",
                                                           "stale", "wrong_neighbours")}
    found = [f"{count} {name}" for name, count in problems.items() if count]
    if report.content_index:
        found.append(report.content_index)
    print("found: " + ", ".join(found))
    if report.repaired:
        rebuilt = (f", content index rebuilt from {report.content_index_rebuilt} chunk text(s)"
                   if report.content_index else "")
        print(f"repaired: {report.recomputed} cache(s) recomputed, {report.removed} text-less entr(y/ies) removed"
              f"{rebuilt}")
        return 0
    print(f"not repaired; run `{PROG} verify --repair` to fix")
    return 1


# ---- learned --------------------------------------------------------------------------------------
def cmd_learned(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag learned`: list the learned caches under --db, or purge one tenant's (no model is loaded)."""
    from fusionrag_core.reuse.inventory import learned_scopes, purge_tenant

    if args.purge:
        if args.tenant is None:
            raise InvalidRequestError("--purge needs --tenant NAME (the tenant whose learned caches to remove)")
        removed = purge_tenant(args.db, args.tenant)
        print(f"removed {len(removed)} folder(s) of tenant {args.tenant!r}: " + ", ".join(map(str, removed))
              if removed else f"no learned caches of tenant {args.tenant!r} under {args.db}")
        return 0
    shown = [s for s in learned_scopes(args.db) if args.tenant is None or s.tenant == args.tenant]
    if not shown:
        print(f"no learned caches under {args.db}" + (f" for tenant {args.tenant!r}" if args.tenant else ""))
    for s in shown:
        salt = "" if s.salt == "-" else f" salt {s.salt[:12]}"
        who = f"tenant {s.tenant!r}{salt}" if s.tenant else "operator / shared"
        print(f"model {s.model}  {who}: {s.caches} cache(s), {s.nbytes / 2**20:.1f} MiB  ({s.path})")
    return 0


# ---- bench ----------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace, engine: Callable[[], FusionEngine], argv: Sequence[str]) -> int:
    """`fusionrag bench --data FILE`: run the benchmark, write the report, print the table."""
    from fusionrag_core.bench.data import load_rows
    from fusionrag_core.bench.report import table, write_report
    from fusionrag_core.bench.runner import BenchConfig, run_benchmark

    methods = tuple(m for item in args.methods for m in item.split(",") if m) if args.methods else DEFAULT_METHODS
    config = BenchConfig(
        data=Path(args.data).expanduser(),
        methods=methods,
        ratios=args.ratios,
        limit=args.limit,
        skip=args.skip,
        neighbours=args.neighbours,
        max_passage_tokens=args.max_passage_tokens,
        max_new_tokens=args.max_new_tokens,
        storage_dtype=args.storage_dtype,
        corpus=args.corpus,
        context=args.context,
        k=args.k,
    )
    load_rows(config.data, 1)  # NOTE: a missing or malformed dataset fails before the model loads.
    results = run_benchmark(config, engine(), progress=not args.no_progress, command=[PROG, *argv])
    paths = write_report(results, args.out)
    print(table(results["results"]))
    ingest = results["ingest"]
    print(f"ingest: independent {ingest['independent_chunks_per_min'] or 0:.1f} chunks/min, "
          f"fused {ingest['fused_chunks_per_min'] or 0:.1f} chunks/min")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


__all__ = [
    "COMMANDS_GROUP",
    "Command",
    "EngineFactory",
    "EngineSpec",
    "UnreadableDocumentError",
    "build_parser",
    "collect_files",
    "document_path",
    "load_engine",
    "main",
    "open_index",
    "plugin_commands",
    "positive_int",
    "read_document",
    "read_documents",
    "where",
]


if __name__ == "__main__":
    # NOTE: run as `python -m`, this file is `__main__`; plugins subclass `fusionrag_core.cli.Command`,
    # so the command line runs from the imported module, whose classes they know.
    from fusionrag_core.cli import main as imported_main

    sys.exit(imported_main())
