"""The routes of `/v1/files` and `/v1/vector_stores` (the work is `files.py` and `vector_stores.py`).

    POST   /v1/files                                   upload (multipart: file, purpose)
    GET    /v1/files, /v1/files/{id}, /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/vector_stores                           create (name, metadata, file_ids)
    GET    /v1/vector_stores, /v1/vector_stores/{id}
    DELETE /v1/vector_stores/{id}
    POST   /v1/vector_stores/{id}/files                add a file: chunked, cached, fused, indexed
    GET    /v1/vector_stores/{id}/files, /v1/vector_stores/{id}/files/{file_id}
    DELETE /v1/vector_stores/{id}/files/{file_id}
    POST   /v1/vector_stores/{id}/search               the chunks most similar to a query

Ingest and search run in worker threads; an unknown id is a 404 in OpenAI's error shape. Files
and vector stores are the tenant's whose key uploaded or created them (`tenants`): another tenant's
id answers 404, and lists hold the asking tenant's only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from fusionrag_core.errors import InvalidRequestError
from fusionrag_integrations.openai_server.errors import HTTPError
from fusionrag_integrations.openai_server.files import NoSuchObjectError
from fusionrag_integrations.openai_server.vector_stores import VectorStores, search_results

T = TypeVar("T")


class CreateVectorStore(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    metadata: dict[str, str] | None = None
    file_ids: list[str] = Field(default_factory=list)
    chunking_strategy: dict[str, Any] | None = None
    expires_after: dict[str, Any] | None = None


class AddFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file_id: str
    chunking_strategy: dict[str, Any] | None = None
    attributes: dict[str, Any] | None = None


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str | list[str]
    max_num_results: int = Field(default=10, ge=1, le=50)
    filters: dict[str, Any] | None = None
    ranking_options: dict[str, Any] | None = None
    rewrite_query: bool = False


def add_store_routes(app: FastAPI, auth: list[Any], stores: VectorStores | None) -> None:
    """Register the files and vector stores routes on `app` (without `stores`: each answers 400,
    saying the server has no data directory for them)."""
    routes = _StoreRoutes(stores)
    for path, handler, method in (
        ("/v1/files", routes.upload, "POST"), ("/v1/files", routes.list_files, "GET"),
        ("/v1/files/{file_id}", routes.get_file, "GET"), ("/v1/files/{file_id}", routes.delete_file, "DELETE"),
        ("/v1/files/{file_id}/content", routes.file_content, "GET"),
        ("/v1/vector_stores", routes.create, "POST"), ("/v1/vector_stores", routes.list_stores, "GET"),
        ("/v1/vector_stores/{vs_id}", routes.retrieve, "GET"), ("/v1/vector_stores/{vs_id}", routes.delete, "DELETE"),
        ("/v1/vector_stores/{vs_id}/files", routes.add_file, "POST"),
        ("/v1/vector_stores/{vs_id}/files", routes.list_vs_files, "GET"),
        ("/v1/vector_stores/{vs_id}/files/{file_id}", routes.get_vs_file, "GET"),
        ("/v1/vector_stores/{vs_id}/files/{file_id}", routes.delete_vs_file, "DELETE"),
        ("/v1/vector_stores/{vs_id}/search", routes.search, "POST"),
    ):
        app.add_api_route(path, handler, methods=[method], dependencies=auth)


class _StoreRoutes:
    def __init__(self, stores: VectorStores | None) -> None:
        self._stores = stores

    # ---- files -------------------------------------------------------------------------------------------
    async def upload(self, request: Request, file: UploadFile, purpose: str = Form(...)) -> dict[str, Any]:
        data = await file.read()
        stores, tenant = self.stores, _tenant(request)
        return await _in_thread(lambda: stores.files.add(file.filename or "upload.txt", data, purpose, tenant))

    async def list_files(self, request: Request) -> dict[str, Any]:
        tenant = _tenant(request)
        return _page(await _in_thread(lambda: self.stores.files.list_files(tenant)))

    async def get_file(self, request: Request, file_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.files.get(file_id, tenant))

    async def file_content(self, request: Request, file_id: str) -> Response:
        tenant = _tenant(request)
        data = await _in_thread(lambda: self.stores.files.content(file_id, tenant))
        return Response(data, media_type="application/octet-stream")

    async def delete_file(self, request: Request, file_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.files.delete(file_id, tenant))

    # ---- vector stores -----------------------------------------------------------------------------------
    async def create(self, request: Request, body: CreateVectorStore) -> dict[str, Any]:
        if body.expires_after is not None:
            raise InvalidRequestError("expires_after is not supported: a vector store lives until it is deleted")
        if body.chunking_strategy not in (None, {"type": "auto"}):
            raise InvalidRequestError("chunking_strategy is set per server (IngestConfig); send {'type': 'auto'} or "
                                      "none")
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.create(body.name, body.metadata, body.file_ids, tenant))

    async def list_stores(self, request: Request) -> dict[str, Any]:
        tenant = _tenant(request)
        return _page(await _in_thread(lambda: self.stores.list_stores(tenant)))

    async def retrieve(self, request: Request, vs_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.retrieve(vs_id, tenant))

    async def delete(self, request: Request, vs_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.delete(vs_id, tenant))

    async def add_file(self, request: Request, vs_id: str, body: AddFile) -> dict[str, Any]:
        if body.attributes:
            raise InvalidRequestError("attributes are not supported on vector store files (no filters search them)")
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.add_file(vs_id, body.file_id, tenant, body.chunking_strategy))

    async def list_vs_files(self, request: Request, vs_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return _page(await _in_thread(lambda: self.stores.list_files(vs_id, tenant)))

    async def get_vs_file(self, request: Request, vs_id: str, file_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.retrieve_file(vs_id, file_id, tenant))

    async def delete_vs_file(self, request: Request, vs_id: str, file_id: str) -> dict[str, Any]:
        tenant = _tenant(request)
        return await _in_thread(lambda: self.stores.delete_file(vs_id, file_id, tenant))

    async def search(self, request: Request, vs_id: str, body: SearchRequest) -> dict[str, Any]:
        if body.filters is not None or body.rewrite_query:
            raise InvalidRequestError("filters and rewrite_query are not supported: the query is embedded as sent "
                                      "and every chunk is searched")
        queries = [body.query] if isinstance(body.query, str) else body.query
        if len(queries) != 1:
            raise InvalidRequestError(f"send one query, got {len(queries)}")
        threshold = (body.ranking_options or {}).get("score_threshold")
        tenant = _tenant(request)
        hits = await _in_thread(lambda: self.stores.search(vs_id, tenant, queries[0], body.max_num_results, threshold))
        return {"object": "vector_store.search_results.page", "search_query": queries,
                "data": list(search_results(hits)), "has_more": False, "next_page": None}

    @property
    def stores(self) -> VectorStores:
        if self._stores is None:
            raise HTTPError(400, "this server has no vector stores: start it with a data directory for them "
                                 "(fusionrag --db DIR serve)", code="vector_stores_unavailable")
        return self._stores


def _tenant(request: Request) -> str:
    """The tenant whose key the request carries (`ChatServer`'s auth sets it before any route runs)."""
    tenant: str = request.state.tenant
    return tenant


async def _in_thread(work: Callable[[], T]) -> T:
    """`work` in a worker thread (ingest, search and file I/O block); an unknown id is a 404."""
    try:
        return await anyio.to_thread.run_sync(work)
    except NoSuchObjectError as e:
        raise HTTPError(404, e.message, code="not_found") from None


def _page(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": False}


__all__ = ["add_store_routes"]
