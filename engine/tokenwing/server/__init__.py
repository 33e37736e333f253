"""`tokenwing serve`: an OpenAI-compatible HTTP API, health, Prometheus metrics and a per-token stats stream."""
