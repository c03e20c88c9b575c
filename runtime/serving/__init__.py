"""runtime/serving/: `mtp-serve`, serving an engine behind Triton Inference Server or an OpenAI-compatible API.

Owns: the CLI that writes the model repository (triton_server.py); the tritonserver process and what it leaves
on the machine: start, supervision, drain, stop, stale-resource sweep (process.py); and the Python-backend
model that runs one engine loop for all requests (triton_model/); the OpenAI-compatible frontend (openai/: FastAPI
routes + SSE, request schema, the engine-loop thread, Prometheus metrics, uvicorn lifecycle). Nothing in the
engine imports it.
"""
