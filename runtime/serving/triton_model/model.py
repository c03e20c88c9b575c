"""Triton Python-backend model `mtp`: one MTP speculative-decoding engine behind a decoupled (streaming) API.

Written into `<model-repo>/mtp/1/model.py` by `mtp-serve` (runtime/serving/triton_server.py) and run by Triton's Python
stub, where `triton_python_backend_utils` exists. The engine and its options come
from the `parameters` of config.pbtxt; `runtime` must be importable by the stub's Python (an installed package
is; mtp-serve also passes its own import path in MTP_SERVE_PYTHONPATH).

Continuous batching: `execute` only parses (and tokenizes) each request and queues it with its response sender, then
returns None (decoupled mode). ONE background thread owns the engine: it admits the queued requests,
calls `engine.step()` (which batches every running request, whichever `execute` call it came from) and
sends each request its responses, the last one with the FINAL flag. A bad request gets one error
response (FINAL) and changes nothing for the others. Prompts are size-checked, then tokenized, in execute()
(never on the engine loop). A control thread drains on mtp-serve's request and exits the stub when
tritonserver dies (triton_model/policy.py; docs/SERVING.md, "Lifecycle").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub's interpreter is isolated (PYTHONPATH ignored), so mtp-serve passes the import path it runs with: the
# stub then imports the same `runtime` as the launcher (a checkout, or site-packages where this is a no-op).
for _p in reversed(os.environ.get("MTP_SERVE_PYTHONPATH", "").split(os.pathsep)):
    if _p and _p not in sys.path:
        sys.path.insert(0, _p)

from runtime.serving.triton_model.exporter import MetricsExporter  # noqa: E402
from runtime.serving.triton_model.policy import (  # noqa: E402
    Control,
    Counts,
    cancelled,
    encode,
    prompt_byte_limit,
    prompt_size_error,
    top_p_off,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BadInput(ValueError):
    """A request whose tensors cannot be turned into a prompt and sampling parameters."""


@dataclass
class _Stream:
    sender: Any  # pb_utils.InferenceResponseSender
    stream: bool
    stops: tuple[str, ...]
    sent_text: str = ""
    num_sent_ids: int = 0


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
    params = {
        "max_tokens": max_tokens,
        "temperature": _scalar(request, "temperature", float, 0.0),
        "top_k": _scalar(request, "top_k", int, 0),
        "top_p": top_p_off(_scalar(request, "top_p", float, 1.0)),
        "seed": _scalar(request, "seed", int),
        "end_id": _scalar(request, "end_id", int),
        "stop": stops,
    }
    return _text(texts[0]), params, bool(_scalar(request, "stream", bool, False))


def _stable_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a growing text that is safe to stream: no half-decoded character at the end, and
    nothing that could still turn out to be the start of a stop string (it would be cut later)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return text[: len(text) - hold]


def _bytes_tensor(name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args.get("model_name", "mtp")
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        opt: dict[str, Any] = {k: (v if v != "" else None) for k, v in params.items()}
        if opt.get("torch_threads"):
            import torch

            torch.set_num_threads(int(opt["torch_threads"]))
        from runtime.core.engine import RequestError
        from runtime.core.sampling import SamplingParams
        from runtime.factory import create_engine

        self._RequestError, self._SamplingParams = RequestError, SamplingParams

        def as_int(key):
            return int(opt[key]) if opt.get(key) is not None else None

        self.engine = create_engine(
            engine_dir=opt.get("engine_dir"),
            checkpoint=opt.get("checkpoint"),
            executor=opt.get("executor") or "onnxruntime",
            num_draft_tokens="auto" if opt.get("num_draft_tokens") == "auto" else as_int("num_draft_tokens"),
            max_batch=as_int("max_batch"),
            num_blocks=as_int("num_blocks"),
        )
        self.k = self.engine.k
        self._tokenizer = getattr(self.engine, "tokenizer", None)
        self._max_prompt_bytes = prompt_byte_limit(self.engine.cfg.max_seq_len, as_int("max_prompt_bytes"))
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._pending: list[tuple[str, str | list[int], dict, _Stream]] = []  # guarded by _cv
        self._active: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False  # guarded by _cv: finalize()
        self._drain_deadline: float | None = None  # guarded by _cv: monotonic time the drain cuts streams short
        self._drain_timeout = 0.0
        self._drained_reported = False
        self.counts = Counts()  # engine thread only, except "rejected" (under _cv)
        self._control = Control.from_env()
        self._exporter = MetricsExporter(pb_utils, self.name, self.k)
        if not self._exporter.ok:
            _log("warn", f"custom metrics unavailable ({self._exporter.error}); per-request stats still work")
        self._thread = threading.Thread(target=self._loop, name="mtp-engine-loop", daemon=True)
        self._thread.start()
        self._parent = os.getppid()
        self._watch = threading.Thread(target=self._watchdog, name="mtp-control", daemon=True)
        self._watch.start()
        import runtime

        _log("info", f"engine ready: runtime={os.path.dirname(runtime.__file__)} executor={opt.get('executor')} "
                     f"num_draft_tokens={self.k} "
                     f"source={opt.get('engine_dir') or opt.get('checkpoint')} metrics={self._exporter.ok} "
                     f"max_prompt_bytes={self._max_prompt_bytes} control={self._control.directory}")  # fmt: skip

    # ------------------------------------------------------------------ lifecycle
    def _watchdog(self) -> None:
        """Exit when tritonserver dies (the stub would otherwise stay, orphaned, holding its memory and shm);
        start draining when mtp-serve asks."""
        while True:
            if os.getppid() != self._parent:
                print("[mtp] tritonserver died: the stub exits", file=sys.stderr, flush=True)
                os._exit(1)  # no cleanup: nobody is left to answer, and interpreter teardown could hang
            with self._cv:
                if self._stopping:
                    return
                if self._drain_deadline is None:
                    timeout = self._control.drain_timeout()
                    if timeout is not None:
                        self._drain_timeout = timeout
                        self._drain_deadline = time.monotonic() + timeout
                        self._cv.notify_all()
            time.sleep(0.1)

    def _draining(self) -> bool:
        with self._cv:
            return self._drain_deadline is not None

    # ------------------------------------------------------------------ requests in
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if self._draining():
                self._reject(sender, "the server is shutting down (draining): send the request to another server")
                continue
            try:
                prompt, params, stream = parse_request(request, self._max_prompt_bytes)
                # Tokenized here, in the stub's request thread, so a long prompt never stalls running streams.
                tokens: str | list[int] = encode(self._tokenizer, prompt) if self._tokenizer is not None else prompt
            except BadInput as e:
                self._reject(sender, str(e))
                continue
            if isinstance(tokens, list) and not tokens and prompt:
                tokens = prompt  # let the engine name the problem
            item = (f"triton-{next(self._ids)}", tokens, params, _Stream(sender, stream, params["stop"]))
            with self._cv:
                if self._stopping or self._drain_deadline is not None:
                    self.counts.add("rejected")
                    self._send_error(sender, "the server is shutting down: send the request to another server")
                    continue
                self._pending.append(item)
                self._cv.notify()
        return None

    def _reject(self, sender, message: str) -> None:
        with self._cv:
            self.counts.add("rejected")
        self._send_error(sender, message)

    # ------------------------------------------------------------------ the engine loop
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._stopping:
                    if self._drain_deadline is not None and not self._drained_reported:
                        break
                    self._export_metrics()
                    self._cv.wait()
                if self._stopping:
                    break
                pending, self._pending = self._pending, []
                deadline = self._drain_deadline
            for req_id, prompt, params, st in pending:
                self._admit(req_id, prompt, params, st)
            self._drop_cancelled()
            if deadline is not None and time.monotonic() >= deadline and self._active:
                self._fail_active(f"the server is shutting down: the stream was cut short after the "
                                  f"{self._drain_timeout:g} s drain timeout")  # fmt: skip
            if deadline is not None and not self._active and not self._drained_reported:
                self._export_metrics()
                self._drained_reported = True
                self._control.report_drained()
            if not self._active:
                continue
            if not self.engine.has_unfinished():  # cannot happen; never spin on it
                self._fail_active("internal error: the engine lost the request")
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail what was in flight, then go on
                _log("error", f"engine step failed: {traceback.format_exc()}")
                self._fail_active(f"engine step failed: {type(e).__name__}: {e}")
                continue
            for out in outputs:
                self._respond(out)
            self._export_metrics()
        with self._cv:
            pending, self._pending = self._pending, []
        for *_, st in pending:
            self.counts.add("rejected")
            self._send_error(st.sender, "the model is shutting down")
        self._fail_active("the model is shutting down")

    def _admit(self, req_id: str, prompt: str | list[int], params: dict, st: _Stream) -> None:
        try:
            self.engine.add_request(prompt, self._SamplingParams(**params), req_id=req_id)
        except self._RequestError as e:
            self.counts.add("rejected")
            self._send_error(st.sender, f"bad request: {e}")
            return
        except Exception as e:
            _log("error", f"add_request failed: {traceback.format_exc()}")
            self.counts.add("rejected")
            self._send_error(st.sender, f"cannot add the request: {type(e).__name__}: {e}")
            return
        self.counts.add("admitted")
        self._active[req_id] = st

    def _drop_cancelled(self) -> None:
        for req_id, st in list(self._active.items()):
            is_cancelled, why = cancelled(st.sender)
            if why:
                _log("warn", f"{req_id}: {why}")
            if is_cancelled:
                self.engine.abort(req_id)
                del self._active[req_id]
                self.counts.add("cancelled")
                self._send(st.sender, None, FINAL)

    def _fail_active(self, message: str) -> None:
        for req_id, st in list(self._active.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(req_id)
            self.counts.add("failed")
            self._send_error(st.sender, message)
        self._active.clear()

    # ------------------------------------------------------------------ responses out
    def _respond(self, out) -> None:
        st = self._active.get(out.req_id)
        if st is None:
            return
        if out.finished:
            del self._active[out.req_id]
            self.counts.add("finished")
        if not st.stream and not out.finished:
            return
        if st.stream:
            text = out.text if out.finished else _stable_text(out.text, st.stops)
            delta = ""
            if text.startswith(st.sent_text):
                delta, st.sent_text = text[len(st.sent_text) :], text
            ids = out.output_ids[st.num_sent_ids :]
            st.num_sent_ids = len(out.output_ids)
            if not out.finished and not ids and not delta:
                return
        else:
            delta, ids = out.text, out.output_ids
        tensors = [_bytes_tensor("text_output", delta), pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32))]
        if out.finished:
            tensors += self._stats(out)
        self._send(st.sender, pb_utils.InferenceResponse(output_tensors=tensors), FINAL if out.finished else 0)

    def _stats(self, out) -> list:
        steps, accepted = out.num_steps, out.accepted_per_step
        total_draft = out.num_proposed  # drafts actually verified (k varies per step under auto)
        total_accepted = int(sum(accepted))
        per_position = [sum(a > i for a in accepted) / steps if steps else 0.0 for i in range(self.k)]
        return [
            _bytes_tensor("finish_reason", out.finish_reason or ""),
            pb_utils.Tensor("acceptance_rate",
                            np.array([total_accepted / total_draft if total_draft else 0.0], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([total_accepted], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([total_draft], dtype=np.int32)),
            pb_utils.Tensor("acceptance_per_position", np.array(per_position, dtype=np.float32)),
        ]  # fmt: skip

    @staticmethod
    def _send(sender, response, flags) -> None:
        try:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)
        except Exception as e:  # the client went away; nothing else to do for it
            _log("warn", f"cannot send a response: {e}")

    def _send_error(self, sender, message: str) -> None:
        self._send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), FINAL)

    # ------------------------------------------------------------------ metrics (served on Triton's /metrics)
    def _export_metrics(self) -> None:
        error = self._exporter.export(self.engine, self.counts, len(self._active))
        if error:
            _log("warn", error)

    # ------------------------------------------------------------------ shutdown
    def finalize(self):
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        self._exporter.close()
