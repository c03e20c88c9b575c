"""The OpenAI-compatible frontend of `mtp-serve --frontend openai`.

Owns: the HTTP API (app.py: FastAPI routes, SSE), the request/response schema (protocol.py), the one
engine-loop thread that batches every request (engine_loop.py), the Prometheus registry (metrics.py)
and the process entry point (server.py: engine creation, uvicorn, SIGTERM drain).
"""
