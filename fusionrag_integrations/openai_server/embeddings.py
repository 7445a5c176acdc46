"""`POST /v1/embeddings` with the corpus's embedding model (all-MiniLM-L6-v2, 384-d, unit norm:
`fusionrag_core.ingest.chroma.default_embedding_function`, what `fusionrag ingest` and the server's
corpus embed with), in OpenAI's shape.

    {"model", "input": text | [texts], "encoding_format": "float" | "base64", "dimensions"?}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

`base64` is the little-endian float32 bytes of each vector (what the `openai` SDK asks for by
default and decodes). A text longer than the model reads whole is refused (the model would cut it),
as are token-id inputs and a `dimensions` other than the model's.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import anyio
import numpy as np
from pydantic import BaseModel, ConfigDict

from fusionrag_core.errors import InvalidRequestError
from fusionrag_core.ingest.chroma import EMBEDDING_ID, MiniLMEmbeddingFunction, default_embedding_function
from fusionrag_integrations.openai_server.errors import HTTPError

MAX_INPUTS = 2048
"""Most texts one request embeds: OpenAI's limit."""
DIMENSIONS = 384
"""all-MiniLM-L6-v2's embedding size."""
MODEL_NAMES = (EMBEDDING_ID, EMBEDDING_ID.rsplit("/", 1)[-1])
"""The names a request may give the embedding model (with or without its organisation)."""


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings`."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    """Accepted as OpenAI does: an end-user id for the caller's own records; it changes no vector."""

    def texts(self) -> list[str]:
        """The texts to embed, in order.

        Raises:
            InvalidRequestError: token ids, an empty text, or more than `MAX_INPUTS` texts.
        """
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError("input must be a text or a list of texts (token ids are not taken: this model "
                                      "has its own tokenizer; LangChain: OpenAIEmbeddings(check_embedding_ctx_length="
                                      "False) sends texts)")
        if len(texts) > MAX_INPUTS:
            raise InvalidRequestError(f"input holds {len(texts)} texts; at most {MAX_INPUTS} per request")
        empty = next((i for i, t in enumerate(texts) if not t), None)
        if empty is not None:
            raise InvalidRequestError(f"input[{empty}] is empty: every text to embed needs at least one character")
        if self.dimensions is not None and self.dimensions != DIMENSIONS:
            raise InvalidRequestError(f"dimensions={self.dimensions} is not supported: {EMBEDDING_ID} embeds in "
                                      f"{DIMENSIONS} dimensions (drop dimensions, or pass {DIMENSIONS})")
        return texts


def embeddings_route() -> Callable[[EmbeddingRequest], Awaitable[dict[str, Any]]]:
    """The `/v1/embeddings` handler (the model loads at its first request)."""

    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        if body.model not in MODEL_NAMES:
            raise HTTPError(404, f"model {body.model!r} is no embedding model of this server: it embeds with "
                                 f"{EMBEDDING_ID!r}", code="model_not_found")
        texts = body.texts()
        vectors, tokens = await anyio.to_thread.run_sync(_embed, texts)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": EMBEDDING_ID,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return embeddings


def _embed(texts: Sequence[str]) -> tuple[np.ndarray, int]:
    """`[N, 384]` float32 unit vectors of `texts`, and their tokens in all (a worker thread's job).

    Raises:
        InvalidRequestError: a text longer than the model reads whole.
    """
    model = default_embedding_function()
    assert isinstance(model, MiniLMEmbeddingFunction)
    counts = model.token_counts(texts)
    over = next((i for i, n in enumerate(counts) if n > model.max_tokens), None)
    if over is not None:
        raise InvalidRequestError(f"input[{over}] has {counts[over]} tokens; {EMBEDDING_ID} reads at most "
                                  f"{model.max_tokens} (it would cut the rest): split the text")
    vectors = np.asarray(model(list(texts)), dtype=np.float32)  # [N, D]
    assert vectors.shape == (len(texts), DIMENSIONS), vectors.shape
    return vectors, sum(counts)


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


__all__ = ["DIMENSIONS", "MAX_INPUTS", "EmbeddingRequest", "embeddings_route"]
