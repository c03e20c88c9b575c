"""Triton Python-backend model `mtp`: one MTP speculative-decoding engine behind a decoupled (streaming) API.

Written into `<model-repo>/mtp/1/model.py` by `mtp-serve` (runtime/serving/triton_server.py) and run by Triton's Python
stub, where `triton_python_backend_utils` exists. The engine and its options come
from the `parameters` of config.pbtxt; `runtime` must be importable by the stub's Python (an installed package
is; mtp-serve also passes its own import path in MTP_SERVE_PYTHONPATH).

A thin adapter over the one engine loop (runtime/serving/engine_loop.py), the same loop the OpenAI frontend uses:
`execute` only parses (and tokenizes) each request and submits it with a sink that owns its response sender,
then returns None (decoupled mode). The loop batches every running request, whichever `execute` call it came
from, and hands each request's news to its sink, which sends it as Triton responses, the last one with the
FINAL flag. A bad request gets one error response (FINAL) and changes nothing for the others. Prompts are
size-checked, then tokenized, in execute() (never on the engine loop). A control thread drains on mtp-serve's
request and exits the stub when tritonserver dies (triton_model/policy.py; docs/SERVING.md, "Lifecycle").
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub's interpreter is isolated (PYTHONPATH ignored), so mtp-serve passes the import path it runs with: the
# stub then imports the same `runtime` as the launcher (a checkout, or site-packages where this is a no-op).
for _p in reversed(os.environ.get("MTP_SERVE_PYTHONPATH", "").split(os.pathsep)):
    if _p and _p not in sys.path:
        sys.path.insert(0, _p)

from runtime.serving.engine_loop import EngineLoop, Event, NotServing, QueueFull, Sink  # noqa: E402
from runtime.serving.limits import default_max_queue, prompt_byte_limit, prompt_size_error, stop_error  # noqa: E402
from runtime.serving.stream_text import TextDelta  # noqa: E402
from runtime.serving.triton_model.exporter import MetricsExporter  # noqa: E402
from runtime.serving.triton_model.policy import Control, cancelled, encode  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BadInput(ValueError):
    """A request whose tensors cannot be turned into a prompt and sampling parameters."""


def _log(level: str, msg: str) -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        getattr(logger, f"log_{level}")(f"[mtp] {msg}")
    else:  # pragma: no cover - very old python backends
        print(f"[mtp] {level}: {msg}", file=sys.stderr, flush=True)


def _values(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    return values if values.size else None


def _scalar(request, name: str, cast, default=None):
    values = _values(request, name)
    if values is None:
        return default
    if values.size != 1:
        raise BadInput(f"{name}: expected one value per request, got {values.size}")
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    try:
        return cast(value)
    except (TypeError, ValueError) as e:
        raise BadInput(f"{name}: cannot read {value!r} as {cast.__name__}") from e


def _text(value) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise BadInput(f"text is not valid UTF-8: {e}") from e


def parse_request(request, max_prompt_bytes: int) -> tuple[str, dict, bool]:
    """Return (prompt, SamplingParams kwargs, stream). Raises BadInput; value checks are the engine's."""
    texts = _values(request, "text_input")
    if texts is None:
        raise BadInput("text_input is missing or empty: send one prompt string")
    if texts.size != 1:
        raise BadInput(f"text_input has {texts.size} strings: send one prompt per request")
    raw = texts[0]
    too_big = prompt_size_error(len(raw) if isinstance(raw, bytes) else len(str(raw).encode()), max_prompt_bytes)
    if too_big:  # checked on the raw bytes, before decoding or tokenizing anything
        raise BadInput(too_big)
    max_tokens = _scalar(request, "max_tokens", int)
    if max_tokens is None:
        raise BadInput("max_tokens is missing: send an INT32 >= 1")
    stop_words = _values(request, "stop_words")
    stops = tuple(s for s in (_text(v) for v in (stop_words if stop_words is not None else ())) if s)
    too_many = stop_error(stops, "stop_words")
    if too_many:
        raise BadInput(too_many)
    params = {
        "max_tokens": max_tokens,
        "temperature": _scalar(request, "temperature", float, 0.0),
        "top_k": _scalar(request, "top_k", int, 0),
        "top_p": _scalar(request, "top_p", float, 1.0),  # 0 is refused, as vLLM and the OpenAI frontend do
        "seed": _scalar(request, "seed", int),
        "end_id": _scalar(request, "end_id", int),
        "stop": stops,
    }
    return _text(texts[0]), params, bool(_scalar(request, "stream", bool, False))


def _bytes_tensor(name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))




def _send(sender, response, flags) -> None:
    try:
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
    except Exception as e:  # the client went away; nothing else to do for it
        _log("warn", f"cannot send a response: {e}")


def _send_error(sender, message: str) -> None:
    _send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), FINAL)


class TritonSink:
    """One request's way out: the engine loop's events as Triton responses on its sender (loop thread only)."""

    def __init__(self, sender: Any, stream: bool, stops: tuple[str, ...], k: int) -> None:
        self.sender, self.stream, self.k = sender, stream, k
        self.text = TextDelta(stops)
        self.sink = Sink(self.put, self.cancelled)

    def cancelled(self) -> bool:
        flag, why = cancelled(self.sender)
        if why:
            _log("warn", why)
        return flag

    def put(self, ev: Event) -> None:
        if ev.error is not None:
            _send_error(self.sender, f"bad request: {ev.error}" if ev.bad_request else ev.error)
            return
        if ev.finished and ev.finish_reason == "abort":  # cancelled by the client: end the stream, nothing else
            _send(self.sender, None, FINAL)
            return
        if not self.stream and not ev.finished:
            return
        if self.stream:
            delta, ids = self.text.next(ev.text, ev.finished), ev.new_token_ids
            if not ev.finished and not ids and not delta:
                return
        else:
            delta, ids = ev.text, ev.output_ids or []
        tensors = [_bytes_tensor("text_output", delta), pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32))]
        if ev.finished:
            tensors += self._stats(ev)
        _send(self.sender, pb_utils.InferenceResponse(output_tensors=tensors), FINAL if ev.finished else 0)

    def _stats(self, ev: Event) -> list:
        steps, accepted = ev.num_steps, ev.accepted_per_step
        total_draft = ev.num_proposed or 0  # drafts actually verified (k varies per step under auto)
        total_accepted = int(sum(accepted))
        per_position = [sum(a > i for a in accepted) / steps if steps else 0.0 for i in range(self.k)]
        return [
            _bytes_tensor("finish_reason", ev.finish_reason or ""),
            pb_utils.Tensor("acceptance_rate",
                            np.array([total_accepted / total_draft if total_draft else 0.0], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([total_accepted], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([total_draft], dtype=np.int32)),
            pb_utils.Tensor("acceptance_per_position", np.array(per_position, dtype=np.float32)),
        ]  # fmt: skip


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args.get("model_name", "mtp")
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        opt: dict[str, Any] = {k: (v if v != "" else None) for k, v in params.items()}
        from runtime.core.sampling import SamplingParams
        from runtime.factory import create_engine, use_threads

        self._SamplingParams = SamplingParams

        def as_int(key):
            return int(opt[key]) if opt.get(key) is not None else None

        engine = create_engine(
            threads=use_threads(as_int("threads")),
            engine_dir=opt.get("engine_dir"),
            checkpoint=opt.get("checkpoint"),
            executor=opt.get("executor") or "auto",
            num_draft_tokens="auto" if opt.get("num_draft_tokens") == "auto" else as_int("num_draft_tokens"),
            max_batch=as_int("max_batch"),
            num_blocks=as_int("num_blocks"),
            num_state_snapshots=as_int("num_state_snapshots"),
            state_snapshot_interval=as_int("state_snapshot_interval"),
        )
        self.k = engine.k
        self._tokenizer = getattr(engine, "tokenizer", None)
        self._max_prompt_bytes = prompt_byte_limit(engine.cfg.max_seq_len, as_int("max_prompt_bytes"))
        max_queue = as_int("max_queue") or default_max_queue(engine.cfg.max_batch)
        self._exporter = MetricsExporter(pb_utils, self.name, self.k)
        if not self._exporter.ok:
            _log("warn", f"custom metrics unavailable ({self._exporter.error}); per-request stats still work")
        self.loop = EngineLoop(engine, max_queue, on_step=self._export, log=_log, id_prefix="triton")
        self.loop.start()
        self._control = Control.from_env()
        self._stopping = threading.Event()
        self._drainer: threading.Thread | None = None
        self._parent = os.getppid()
        self._watch = threading.Thread(target=self._watchdog, name="mtp-control", daemon=True)
        self._watch.start()
        import runtime

        _log("info", f"engine ready: runtime={os.path.dirname(runtime.__file__)} executor={engine.executor_name} "
                     f"num_draft_tokens={self.k} "
                     f"source={opt.get('engine_dir') or opt.get('checkpoint')} metrics={self._exporter.ok} "
                     f"max_prompt_bytes={self._max_prompt_bytes} max_queue={max_queue} "
                     f"control={self._control.directory}")  # fmt: skip

    # ------------------------------------------------------------------ lifecycle
    def _watchdog(self) -> None:
        """Exit when tritonserver dies (the stub would otherwise stay, orphaned, holding its memory and shm);
        start draining when mtp-serve asks."""
        while not self._stopping.is_set():
            if os.getppid() != self._parent:
                print("[mtp] tritonserver died: the stub exits", file=sys.stderr, flush=True)
                os._exit(1)  # no cleanup: nobody is left to answer, and interpreter teardown could hang
            if self._drainer is None:
                timeout = self._control.drain_timeout()
                if timeout is not None:
                    self._drainer = threading.Thread(target=self._drain, args=(timeout,), name="mtp-drain",
                                                     daemon=True)  # fmt: skip
                    self._drainer.start()
            time.sleep(0.1)

    def _drain(self, timeout_s: float) -> None:
        """Refuse new requests, let the streams run for timeout_s, cut the rest, stop the loop, tell mtp-serve."""
        self.loop.drain(timeout_s)
        self._control.report_drained()

    # ------------------------------------------------------------------ requests in
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if self.loop.draining:
                self.loop.reject()
                _send_error(sender, "the server is shutting down (draining): send the request to another server")
                continue
            try:
                prompt, params, stream = parse_request(request, self._max_prompt_bytes)
                # Tokenized here, in the stub's request thread, so a long prompt never stalls running streams.
                tokens: str | list[int] = encode(self._tokenizer, prompt) if self._tokenizer is not None else prompt
            except BadInput as e:
                self.loop.reject()
                _send_error(sender, str(e))
                continue
            if isinstance(tokens, list) and not tokens and prompt:
                tokens = prompt  # let the engine name the problem
            sink = TritonSink(sender, stream, params["stop"], self.k)
            try:
                self.loop.submit(tokens, self._SamplingParams(**params), sink.sink)
            except (NotServing, QueueFull) as e:
                _send_error(sender, str(e))
        return None

    # ------------------------------------------------------------------ metrics (served on Triton's /metrics)
    def _export(self, stats) -> None:
        error = self._exporter.export(stats)
        if error:
            _log("warn", error)

    # ------------------------------------------------------------------ shutdown
    def finalize(self):
        self._stopping.set()
        self.loop.stop(timeout_s=30)
        self._exporter.close()
