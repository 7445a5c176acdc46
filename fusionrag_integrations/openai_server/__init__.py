"""The OpenAI-compatible HTTP server (`fusionrag serve`): any OpenAI client gets FusionRAG's reuse.

* `create_app(session, config, vector_stores)`: the FastAPI app (app.py; vector stores: vector_stores.py).
* `ServerConfig`: where it listens, its API key and limits (config.py).
"""

from fusionrag_integrations.openai_server.app import create_app
from fusionrag_integrations.openai_server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
