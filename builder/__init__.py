"""The engine builder: a Hugging Face checkpoint directory -> a checked, versioned engine directory.

Owns everything between `mtp-build` and the files the runtime loads (docs/ENGINE_FORMAT.md):

* `options`     build options and their validation (limits, draft depth, parallel mapping, backend);
* `graphs`      the three graph wrappers (main / mtp_draft / mtp_commit) over the I/O contract of the format;
* `export`      dynamo ONNX export of each graph for each rank, weights as external data;
* `ort_build`   the onnxruntime backend (ORT-optimized copies + recorded session options);
* `trt_build`   the tensorrt backend (strongly typed networks, profiles, timing cache, plans);
* `validate`    the checks that run before anything is written (output safety, weights, tokenizer, memory);
* `pipeline`    the named build steps and the atomic rename that makes a build all-or-nothing;
* `signals`     SIGTERM / SIGINT / SIGHUP during a build: an exception that removes its temporary directory;
* `rank_process` one rank's load + export in a child process (a multi-rank build's memory is one rank's share);
* `cli`         `mtp-build` (build / --check) with rich progress and a summary table.

It does not own the model math (models/), the plugin ops or their ONNX/ORT/TensorRT bindings (plugins/), the
engine format (models/engine_format/: KV layout, config.json, manifest, graph I/O specs, session options)
or how engines are executed (runtime/executors/).
"""
