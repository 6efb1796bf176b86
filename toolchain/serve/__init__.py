"""``dstc serve``: OpenAI-compatible HTTP serving of a built artifact with continuous batching (server.py), the
engine that batches requests on each backend (engine*.py), the API (api.py, schemas.py, text.py), metrics and
health (metrics.py, health.py)."""
