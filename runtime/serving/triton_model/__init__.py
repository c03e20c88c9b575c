"""The Triton model that `mtp-serve` writes into a model repository (see docs/SERVING.md).

`model.py` is copied as is to `<repo>/mtp/1/model.py` and runs inside Triton's Python-backend stub, where it
imports `policy.py` (request and drain rules, free of Triton so they are tested here) and `exporter.py` (its
Prometheus metrics). `config_template.py` holds the `config.pbtxt` text that `runtime.serving.triton_server`
fills in.
"""
