"""runtime/serving/: `mtp-serve`, serving an engine behind Triton Inference Server.

Owns: the launcher that writes the model repository and supervises tritonserver (triton_server.py) and the
Python-backend model that runs one engine loop for all requests (triton_model/). Nothing in the engine
imports it.
"""
