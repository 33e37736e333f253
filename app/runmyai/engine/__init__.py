"""Qt-free link to the TokenWing engine: only its CLI and HTTP API, never its Python internals.

supervisor.EngineSupervisor runs `tokenwing serve`; client.ChatClient and stats.StatsClient talk to it (or to
any OpenAI-compatible server, endpoint.Endpoint.remote); autotune.AutotuneRunner runs `tokenwing autotune`.
See docs/app-engine.md.
"""
