"""The public Python API: `from runtime import LLM, SamplingParams, build_engine` (re-exported by runtime/__init__.py).

    from runtime import LLM, SamplingParams, build_engine

    engine_dir = build_engine("models/deep", "engines/deep")        # mtp-build from Python (same defaults)
    llm = LLM(engine_dir, num_draft_tokens=2)                        # or LLM("models/deep"): a checkpoint, torch
    for out in llm.generate(["def main(", "class A:"], SamplingParams(max_tokens=32)):
        print(out.text, out.mean_acceptance_length)

These names are the API that refactors keep in place; tests/test_public_api.py pins them (the set, their
signatures, their behaviour). The engine-level loop (`create_engine`, `LLMEngine.add_request` / `step` /
`stream`) is exported too, for callers that drive the steps themselves.

Errors are ValueError subclasses with one line naming the problem and the fix: `ConfigError` for bad options
(LLM), `RequestError` for a rejected prompt or sampling parameters (generate: "prompt 2: ..."; nothing runs),
the builder's `BuildError` / `CheckpointError` / `EngineDirError` for build_engine.

Room: an application (docs/ARCHITECTURE.md §2, floor 6): it assembles engines with runtime.factory and builds
them with the builder (imported inside build_engine only, so `LLM` stays torch-free until a model loads).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from models.engine_format import looks_like_engine_dir
from runtime.core.admission import RequestError
from runtime.core.config import ConfigError
from runtime.core.engine import LLMEngine
from runtime.core.logprobs import TokenLogprob
from runtime.core.request import RequestOutput
from runtime.core.sampling import SamplingParams, is_int
from runtime.factory import create_engine

__all__ = ["LLM", "ConfigError", "GenerationOutput", "RequestError", "SamplingParams", "TokenLogprob", "build_engine",
           "create_engine"]  # fmt: skip

Prompt = str | Sequence[int]  # text (needs the model's tokenizer.json) or token ids


@dataclass(slots=True)
class GenerationOutput:
    """One prompt's result from `LLM.generate`: what an `mtp-run --json` record holds, plus logprobs."""

    prompt: str | list[int]  # as given (token ids as a list of int)
    text: str  # the detokenized output ("" when the model has no tokenizer), cut before a matched stop string
    token_ids: list[int]  # the generated token ids
    finish_reason: str  # "stop" (end id or stop string), "length" (max_tokens / max_seq_len), "error"
    logprobs: list[TokenLogprob] | None  # one per generated token when params.logprobs is set, else None
    prompt_logprobs: list[TokenLogprob | None] | None  # params.prompt_logprobs: one per prompt token (first: None)
    num_steps: int  # verify steps (decode steps of the speculative loop; the first token comes from the prefill)
    accepted_per_step: list[int]  # accepted draft tokens of each verify step
    num_proposed: int  # draft tokens verified over all steps (acceptance rate = sum(accepted_per_step) / this)
    mean_acceptance_length: float  # tokens per verify step, the main model's own token included (0.0: no step)
    error: str | None = None  # finish_reason "error": why the engine aborted this request (the others ran on)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0.0 when none were proposed, e.g. num_draft_tokens=0)."""
        return sum(self.accepted_per_step) / self.num_proposed if self.num_proposed else 0.0


class LLM:
    """Offline generation over one engine in this process (single rank; under mpirun use `mtp-run`)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        executor: str = "auto",
        num_draft_tokens: int | Literal["auto", "per-request"] | None = None,
        max_batch: int | None = None,
        max_num_tokens: int | None = None,
        max_seq_len: int | None = None,
        num_blocks: int | None = None,
        max_prefill_chunk: int | None = None,
        enable_prefix_caching: bool | None = None,
        threads: int | None = None,
        device: str = "cpu",
        cuda_graphs: bool = False,
        seed: int = 0,
        **engine_options: Any,
    ) -> None:
        """Args:
            model: an engine directory written by mtp-build / `build_engine` (its config.json has the engine
                format's schema_version), or a Hugging Face checkpoint directory, which runs on the torch
                executor without a build.
            executor: auto | compiled | onnxruntime | torch | tensorrt. auto: for an engine its compiled packages
                when this machine can run them, else onnxruntime (tensorrt for a TensorRT engine); for a
                checkpoint torch. A checkpoint runs on torch only.
            num_draft_tokens: K, the MTP draft depths per step; 0 = plain decoding, "auto" = picked per step up to
                the built K, "per-request" = each request its own per step. None: "per-request" up to the engine's
                recorded K (a checkpoint: 3), runtime/core/config.py DEFAULT_DRAFT_TOKENS.
            max_batch, max_num_tokens, max_seq_len, num_blocks, max_prefill_chunk, enable_prefix_caching: the
                runtime limits (runtime/core/config.py RuntimeConfig). None: the engine's build limits (a
                checkpoint: RuntimeConfig's defaults); an engine refuses values above its build limits.
            threads: CPU threads: ONNX Runtime's intra-op threads, and torch.set_num_threads (process-wide) when
                torch is loaded (the torch and compiled executors). None: unchanged.
            device, cuda_graphs: the torch executor's device ("cpu" / "cuda") and CUDA-graph replay.
            seed: the engine seed; a request without SamplingParams.seed samples from (seed, request id).
            engine_options: any other `create_engine` argument or RuntimeConfig field (prefix_cache_cow,
                commit_pass, wrap_executor, ...), passed through unchanged.
        Raises ConfigError (a ValueError) naming a bad path or option; the engine and checkpoint loaders raise
        EngineDirError / CheckpointError (ValueErrors) for a broken directory.
        """
        path = Path(model)
        if not path.is_dir():
            raise ConfigError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}: give an engine "
                              "directory (mtp-build / build_engine) or a Hugging Face checkpoint directory")  # fmt: skip
        is_engine = looks_like_engine_dir(path)  # config.json with the engine format's fields, else a checkpoint
        self.engine: LLMEngine = create_engine(
            path if is_engine else None, None if is_engine else path, executor=executor, device=device,
            cuda_graphs=cuda_graphs, threads=threads, seed=seed,
            num_draft_tokens=num_draft_tokens, max_batch=max_batch, max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len, num_blocks=num_blocks, max_prefill_chunk=max_prefill_chunk,
            enable_prefix_caching=enable_prefix_caching, **engine_options,
        )  # fmt: skip
        if threads is not None and "torch" in sys.modules:
            import torch

            torch.set_num_threads(threads)
        self.model = path
        self.last_summary: dict | None = None  # the last generate's run metrics (mtp-run's summary)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationOutput]:
        """Run the prompts to completion, batched by the engine; one output per prompt, in prompt order.

        Args:
            prompts: a str, a list of str, a list of token-id lists, or one token-id list (a flat list of ints
                is one prompt: an int is never a prompt).
            params: one SamplingParams for every prompt, one per prompt, or None (SamplingParams(): greedy, 16
                tokens).
            use_tqdm: a progress bar of finished prompts on stderr, shown only for 2+ prompts and when stderr is
                a terminal (rich, as mtp-bench draws its progress).
        Raises RequestError (a ValueError) with one line naming the first rejected prompt ("prompt 2: token ids
        [4099] are outside the vocabulary [0, 2048)") before anything runs: no prompt of the call is generated.
        A request the engine aborts while running (e.g. non-finite logits) is not raised: its output has
        finish_reason "error" and the reason in `error`, and the other prompts finish normally.
        Also sets `last_summary`: the run metrics mtp-run prints (acceptance per position, tokens/s, ...).
        """
        items = _prompt_list(prompts)
        per_prompt = _params_list(params, len(items))
        engine = self.engine
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(items, per_prompt, strict=True)):
                try:
                    ids.append(engine.add_request(prompt, p))
                except RequestError as e:
                    raise RequestError(f"prompt {i}: {e}") from None
            engine.reset_metrics()
            t0 = time.perf_counter()
            mine = set(ids)
            with _progress(len(ids), use_tqdm) as advance:
                for out in engine.stream():  # steps until no request is left (requests added to .engine too)
                    if out.finished and out.req_id in mine:
                        final[out.req_id] = out
                        advance()
        except BaseException:  # a rejected prompt, Ctrl-C, an executor failure: leave the engine with no request
            for rid in ids:
                engine.abort(rid)
            raise
        self.last_summary = {"executor": engine.executor_name,
                             **engine.metrics.summary(time.perf_counter() - t0, len(ids))}  # fmt: skip
        return [_output(prompt, p, final[rid]) for prompt, p, rid in zip(items, per_prompt, ids, strict=True)]


def build_engine(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    backend: str = "onnxruntime",
    dtype: str = "float32",
    max_batch: int = 8,
    max_num_tokens: int = 256,
    max_seq_len: int = 512,
    kv_block_size: int = 16,
    num_draft_tokens: int = 2,
    world_size: int = 1,
    ep_size: int | None = None,
    tp_size: int = 1,
    force: bool = False,
    compile: str | None = None,
    quantize: str = "none",
    quantize_mtp: str = "same",
    quantize_lm_head: bool = False,
    int4_group_size: int = 64,  # builder/options.py INT4_GROUP_DEFAULT (not imported: `import runtime` stays cheap;
    # tests/test_public_api.py pins the two equal)
    keep_onnx: bool = False,
    verbose: bool = True,
) -> Path:
    """`mtp-build --checkpoint CHECKPOINT --output OUTPUT` from Python, with mtp-build's defaults: each keyword is the
    flag of the same name (--kv-block-size: kv_block_size); ep_size None: tp_size when it is > 1, else 1, and
    compile None: mtp-build's default (builder/options.py BuildOptions), as mtp-build. The build is atomic: OUTPUT
    appears complete or not at all. verbose: mtp-build's step lines on stderr when it is a terminal.

    Returns the engine directory (OUTPUT), ready for `LLM(...)`. Raises BuildError / CheckpointError /
    EngineDirError (ValueErrors, one line each) for bad options, a bad checkpoint or an OUTPUT it will not
    replace (force=True replaces an engine directory, never anything else); BuildInterrupted on SIGINT / SIGTERM.
    """
    from builder.options import BuildOptions, default_ep_size
    from builder.pipeline import Reporter, build

    if ep_size is None:
        ep_size = default_ep_size(tp_size)
    opts = BuildOptions(checkpoint=Path(checkpoint), output=Path(output), backend=backend, dtype=dtype,
                        max_batch=max_batch, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                        kv_block_size=kv_block_size, num_draft_tokens=num_draft_tokens, world_size=world_size,
                        ep_size=ep_size, tp_size=tp_size, force=force, quantize=quantize,
                        quantize_mtp=quantize_mtp, quantize_lm_head=quantize_lm_head, int4_group_size=int4_group_size,
                        keep_onnx=keep_onnx, **({} if compile is None else {"compile": compile}))  # fmt: skip
    reporter: Reporter | None = None
    if verbose and sys.stderr.isatty():
        from rich.console import Console

        from builder.cli import RichReporter

        reporter = RichReporter(Console(stderr=True))
    return Path(build(opts, reporter).config.path)


def _prompt_list(prompts: object) -> list[Any]:
    if isinstance(prompts, str | bytes | bytearray | memoryview):  # bytes: one prompt, rejected with its own hint
        return [prompts]
    try:
        items = list(prompts)  # type: ignore[call-overload]
    except TypeError:
        raise RequestError(f"prompts must be a str, a list of str or a list of token-id lists, got "
                           f"{type(prompts).__name__}") from None  # fmt: skip
    return [items] if items and all(is_int(t) for t in items) else items


def _params_list(params: object, n: int) -> list[Any]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    try:
        per_prompt = list(params)  # type: ignore[call-overload]
    except TypeError:
        raise RequestError(f"params must be a SamplingParams, a list of them (one per prompt) or None, got "
                           f"{type(params).__name__}") from None  # fmt: skip
    if len(per_prompt) != n:
        raise RequestError(f"{len(per_prompt)} SamplingParams for {n} prompt(s): give one for all, or one per prompt")
    return per_prompt


def _output(prompt: Any, params: SamplingParams | None, out: RequestOutput) -> GenerationOutput:
    steps, accepted = out.num_steps, list(out.accepted_per_step)
    want_logprobs = params is not None and params.logprobs is not None
    want_prompt = params is not None and params.prompt_logprobs is not None
    return GenerationOutput(
        prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt], text=out.text,
        token_ids=list(out.output_ids), finish_reason=out.finish_reason or "error",
        logprobs=list(out.logprobs) if want_logprobs else None,
        prompt_logprobs=list(out.prompt_logprobs) if want_prompt else None,
        num_steps=steps, accepted_per_step=accepted, num_proposed=out.num_proposed,
        mean_acceptance_length=(sum(accepted) + steps) / steps if steps else 0.0, error=out.error,
    )  # fmt: skip


@contextmanager
def _progress(total: int, wanted: bool) -> Iterator[Callable[[], None]]:
    """advance() once per finished prompt; a rich bar on stderr for 2+ prompts on a terminal, else nothing."""
    if not wanted or total < 2 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)  # fmt: skip
    with bar:
        task = bar.add_task("generate", total=total)
        yield lambda: bar.advance(task)
