"""The OpenAI-compatible HTTP server (`fusionrag serve`): any OpenAI client gets FusionRAG's reuse.

* `create_app(session, config)`: the FastAPI app (app.py).
* `ServerConfig`: where it listens, its API key and limits (config.py).
"""

from fusionrag_integrations.openai_server.app import create_app
from fusionrag_integrations.openai_server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
