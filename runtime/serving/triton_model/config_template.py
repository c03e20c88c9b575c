"""The config.pbtxt of the `mtp` model; `runtime.serving.triton_server.render_config` fills $name and $parameters.

Tensor names follow the TensorRT-LLM backend where they overlap. Every input is a 1-D tensor of one
request (max_batch_size 0): batching happens inside the model, in the engine's continuous-batching loop.
"""

CONFIG_TEMPLATE = """\
# Written by mtp-serve (runtime/serving/triton_server.py); regenerate it instead of editing it.
name: "$name"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ -1 ] optional: true },
  { name: "temperature" data_type: TYPE_FP32 dims: [ -1 ] optional: true },
  { name: "top_k" data_type: TYPE_INT32 dims: [ -1 ] optional: true },
  { name: "top_p" data_type: TYPE_FP32 dims: [ -1 ] optional: true },
  { name: "seed" data_type: TYPE_INT64 dims: [ -1 ] optional: true },
  { name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true },
  { name: "end_id" data_type: TYPE_INT32 dims: [ -1 ] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "output_ids" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "finish_reason" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "acceptance_rate" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "total_accepted_draft_tokens" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "total_draft_tokens" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "acceptance_per_position" data_type: TYPE_FP32 dims: [ -1 ] }
]
# One instance = one engine: requests of every execute() call are batched by its single engine loop.
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters [
$parameters
]
"""
