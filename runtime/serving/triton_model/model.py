"""Triton Python-backend model `mtp`: one MTP speculative-decoding engine behind a decoupled (streaming) API.

Written into `<model-repo>/mtp/1/model.py` by `mtp-serve` (runtime/serving/triton_server.py) and run by Triton's Python
stub, where `triton_python_backend_utils` exists. The engine, its options and the repository root come
from the `parameters` of config.pbtxt.

Continuous batching: `execute` only parses each request and queues it with its response sender, then
returns None (decoupled mode). ONE background thread owns the engine: it admits the queued requests,
calls `engine.step()` (which batches every running request, whichever `execute` call it came from) and
sends each request its responses, the last one with the FINAL flag. A bad request gets one error
response (FINAL) and changes nothing for the others.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

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


def parse_request(request) -> tuple[str, dict, bool]:
    """Return (prompt, SamplingParams kwargs, stream). Raises BadInput; value checks are the engine's."""
    texts = _values(request, "text_input")
    if texts is None:
        raise BadInput("text_input is missing or empty: send one prompt string")
    if texts.size != 1:
        raise BadInput(f"text_input has {texts.size} strings: send one prompt per request")
    max_tokens = _scalar(request, "max_tokens", int)
    if max_tokens is None:
        raise BadInput("max_tokens is missing: send an INT32 >= 1")
    stop_words = _values(request, "stop_words")
    stops = tuple(s for s in (_text(v) for v in (stop_words if stop_words is not None else ())) if s)
    params = {
        "max_tokens": max_tokens,
        "temperature": _scalar(request, "temperature", float, 0.0),
        "top_k": _scalar(request, "top_k", int, 0),
        "top_p": _scalar(request, "top_p", float, 1.0),
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
        if opt.get("repo_root") and opt["repo_root"] not in sys.path:
            sys.path.insert(0, opt["repo_root"])
        if opt.get("torch_threads"):
            import torch

            torch.set_num_threads(int(opt["torch_threads"]))
        from runtime.engine import RequestError
        from runtime.factory import create_engine
        from runtime.sampling import SamplingParams

        self._RequestError, self._SamplingParams = RequestError, SamplingParams

        def as_int(key):
            return int(opt[key]) if opt.get(key) is not None else None

        self.engine = create_engine(
            engine_dir=opt.get("engine_dir"),
            checkpoint=opt.get("checkpoint"),
            executor=opt.get("executor") or "onnxruntime",
            num_draft_tokens=as_int("num_draft_tokens"),
            max_batch=as_int("max_batch"),
            num_blocks=as_int("num_blocks"),
        )
        self.k = self.engine.k
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._pending: list[tuple[str, str, dict, _Stream]] = []  # guarded by _cv
        self._active: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False
        self._init_metrics()
        self._thread = threading.Thread(target=self._loop, name="mtp-engine-loop", daemon=True)
        self._thread.start()
        _log("info", f"engine ready: executor={opt.get('executor')} num_draft_tokens={self.k} "
                     f"source={opt.get('engine_dir') or opt.get('checkpoint')} metrics={self._metrics_ok}")  # fmt: skip

    # ------------------------------------------------------------------ requests in
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, params, stream = parse_request(request)
            except BadInput as e:
                self._send_error(sender, str(e))
                continue
            item = (f"triton-{next(self._ids)}", prompt, params, _Stream(sender, stream, params["stop"]))
            with self._cv:
                if self._stopping:
                    self._send_error(sender, "the model is shutting down")
                    continue
                self._pending.append(item)
                self._cv.notify()
        return None

    # ------------------------------------------------------------------ the engine loop
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
                pending, self._pending = self._pending, []
            for req_id, prompt, params, st in pending:
                self._admit(req_id, prompt, params, st)
            self._drop_cancelled()
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
            self._send_error(st.sender, "the model is shutting down")
        self._fail_active("the model is shutting down")

    def _admit(self, req_id: str, prompt: str, params: dict, st: _Stream) -> None:
        try:
            self.engine.add_request(prompt, self._SamplingParams(**params), req_id=req_id)
        except self._RequestError as e:
            self._send_error(st.sender, f"bad request: {e}")
            return
        except Exception as e:
            _log("error", f"add_request failed: {traceback.format_exc()}")
            self._send_error(st.sender, f"cannot add the request: {type(e).__name__}: {e}")
            return
        self._active[req_id] = st

    def _drop_cancelled(self) -> None:
        for req_id, st in list(self._active.items()):
            try:
                cancelled = st.sender.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                self.engine.abort(req_id)
                del self._active[req_id]
                self._send(st.sender, None, FINAL)

    def _fail_active(self, message: str) -> None:
        for req_id, st in list(self._active.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(req_id)
            self._send_error(st.sender, message)
        self._active.clear()

    # ------------------------------------------------------------------ responses out
    def _respond(self, out) -> None:
        st = self._active.get(out.req_id)
        if st is None:
            return
        if out.finished:
            del self._active[out.req_id]
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
        total_draft = steps * self.k  # every decode verify step checks k drafts
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
    def _init_metrics(self) -> None:
        self._metrics: list = []
        self._families: list = []
        self._metrics_ok = False
        try:
            fam = pb_utils.MetricFamily
            proposed = fam(
                name="mtp_draft_tokens_proposed_total",
                kind=fam.COUNTER,
                description="MTP draft tokens proposed, by draft position (0 = first draft)",
            )
            accepted = fam(
                name="mtp_draft_tokens_accepted_total",
                kind=fam.COUNTER,
                description="MTP draft tokens accepted, by draft position (0 = first draft)",
            )
            rate = fam(
                name="mtp_draft_acceptance_rate",
                kind=fam.GAUGE,
                description="accepted / proposed draft tokens by position, since the model loaded",
            )
            length = fam(name="mtp_mean_acceptance_length", kind=fam.GAUGE,
                         description="tokens emitted per decode verify step, bonus token included")  # fmt: skip
            self._families = [proposed, accepted, rate, length]
            labels = [{"model": self.name, "position": str(i)} for i in range(self.k)]
            self._m_proposed = [proposed.Metric(labels=lab) for lab in labels]
            self._m_accepted = [accepted.Metric(labels=lab) for lab in labels]
            self._m_rate = [rate.Metric(labels=lab) for lab in labels]
            self._m_length = length.Metric(labels={"model": self.name})
            self._metrics = [*self._m_proposed, *self._m_accepted, *self._m_rate, self._m_length]
            self._last_proposed = [0] * self.k
            self._last_accepted = [0] * self.k
            self._metrics_ok = True
        except Exception as e:
            _log("warn", f"custom metrics unavailable ({e}); per-request acceptance_per_position still works")
            self._metrics, self._families = [], []

    def _export_metrics(self) -> None:
        if not self._metrics_ok:
            return
        m = self.engine.metrics
        try:
            for i in range(self.k):
                dp, da = (
                    m.proposed_per_position[i] - self._last_proposed[i],
                    m.accepted_per_position[i] - self._last_accepted[i],
                )
                if dp:
                    self._m_proposed[i].increment(dp)
                if da:
                    self._m_accepted[i].increment(da)
                self._last_proposed[i], self._last_accepted[i] = m.proposed_per_position[i], m.accepted_per_position[i]
                self._m_rate[i].set(m.acceptance_rate_per_position[i])
            self._m_length.set(m.mean_acceptance_length)
        except Exception as e:
            _log("warn", f"metrics update failed, disabling it: {e}")
            self._metrics_ok = False

    # ------------------------------------------------------------------ shutdown
    def finalize(self):
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        self._metrics_ok = False
        self._metrics.clear()  # Metric objects must go before their MetricFamily
        self.__dict__.pop("_m_proposed", None)
        self.__dict__.pop("_m_accepted", None)
        self.__dict__.pop("_m_rate", None)
        self.__dict__.pop("_m_length", None)
        self._families.clear()
