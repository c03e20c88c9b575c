"""Templates of the Triton model that `mtp-serve` writes into a model repository (see docs/SERVING.md).

`model.py` is copied as is to `<repo>/mtp/1/model.py` (it runs inside Triton's Python-backend stub, not
here); `config_template.py` holds the `config.pbtxt` text that `runtime.serving.triton_server` fills in.
"""
