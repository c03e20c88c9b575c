"""The public Python API (runtime/api.py, re-exported by runtime/__init__.py) is pinned here: the exact set of names,
where users import them from, the parameters of LLM / generate / build_engine, and the behaviour (lossless greedy
across K and against the engine-level loop, logprobs, per-prompt params, token-id prompts, one-line rejections).
A refactor that moves or renames any of it fails this file; change it only with the README's "Python API".
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import runtime
from runtime import LLM, ConfigError, GenerationOutput, RequestError, SamplingParams, TokenLogprob, build_engine

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny"
PUBLIC = {"LLM", "ConfigError", "GenerationOutput", "RequestError", "SamplingParams", "TokenLogprob", "build_engine",
          "create_engine"}  # fmt: skip
PROMPTS: list[str | list[int]] = ["def main(", "class Foo:", [5, 6, 7, 8]]
MAX_TOKENS = 12


# ----------------------------------------------------------------------------------------------- the names
def test_public_names_are_exactly_these_and_import_from_runtime():
    assert set(runtime.__all__) == PUBLIC and len(runtime.__all__) == len(PUBLIC)
    from runtime import api

    for name in PUBLIC:
        assert getattr(runtime, name) is getattr(api, name), name
    assert set(dir(runtime)) >= PUBLIC
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        runtime.nope  # noqa: B018
    # the same objects the engine-level modules define (one SamplingParams, one create_engine)
    from runtime.core.admission import RequestError as EngineRequestError
    from runtime.core.config import ConfigError as EngineConfigError
    from runtime.core.sampling import SamplingParams as EngineParams
    from runtime.factory import create_engine

    assert (runtime.SamplingParams, runtime.create_engine) == (EngineParams, create_engine)
    assert (RequestError, ConfigError) == (EngineRequestError, EngineConfigError)
    assert issubclass(RequestError, ValueError) and issubclass(ConfigError, ValueError)


def test_import_runtime_stays_cheap():
    """Every CLI imports `runtime`: it must not load the engine or torch; the API names load the control plane only."""
    code = ("import os, sys\nimport runtime\n"
            "print(os.environ['OMP_WAIT_POLICY'], [m for m in ('torch', 'runtime.api', 'runtime.factory') if m in sys.modules])\n"
            "from runtime import LLM, SamplingParams, build_engine, create_engine\n"
            "print([m for m in ('torch', 'onnx', 'onnxruntime', 'builder') if m in sys.modules])\n")  # fmt: skip
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["PASSIVE []", "[]"]


def _params(fn) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signatures():
    empty = inspect.Parameter.empty
    kw = "KEYWORD_ONLY"
    assert _params(LLM.__init__) == [
        ("self", "POSITIONAL_OR_KEYWORD", empty), ("model", "POSITIONAL_OR_KEYWORD", empty),
        ("executor", kw, "auto"), ("num_draft_tokens", kw, None), ("max_batch", kw, None),
        ("max_num_tokens", kw, None), ("max_seq_len", kw, None), ("num_blocks", kw, None),
        ("max_prefill_chunk", kw, None), ("enable_prefix_caching", kw, None), ("threads", kw, None),
        ("device", kw, "cpu"), ("cuda_graphs", kw, False), ("seed", kw, 0), ("engine_options", "VAR_KEYWORD", empty),
    ]  # fmt: skip
    assert _params(LLM.generate) == [("self", "POSITIONAL_OR_KEYWORD", empty),
                                     ("prompts", "POSITIONAL_OR_KEYWORD", empty),
                                     ("params", "POSITIONAL_OR_KEYWORD", None),
                                     ("use_tqdm", "POSITIONAL_OR_KEYWORD", True)]  # fmt: skip
    assert [f.name for f in dataclasses.fields(GenerationOutput)] == [
        "prompt", "text", "token_ids", "finish_reason", "logprobs", "prompt_logprobs", "num_steps", "accepted_per_step",
        "num_proposed", "mean_acceptance_length", "error"]  # fmt: skip
    assert [f.name for f in dataclasses.fields(TokenLogprob)] == ["token_id", "logprob", "top_ids", "top_logprobs"]


def test_build_engine_has_mtp_builds_flags_and_defaults():
    """build_engine(checkpoint, output, **flags): every mtp-build build flag, same names, same defaults (compile
    None: BuildOptions' default, which is mtp-build's)."""
    from builder.cli import parser
    from builder.options import BuildOptions

    # --threads: the process's own count (a Python caller sets torch's), not a build option
    flags = {a.dest: a.default for a in parser()._actions if a.dest not in ("help", "checkpoint", "output", "check",
                                                                             "debug", "threads")}  # fmt: skip
    params = _params(build_engine)
    assert params[:2] == [("checkpoint", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
                          ("output", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty)]  # fmt: skip
    assert params[-1] == ("verbose", "KEYWORD_ONLY", True)
    assert all(kind == "KEYWORD_ONLY" for _, kind, _ in params[2:])
    defaults = {name: default for name, _, default in params[2:-1]}
    assert defaults.pop("compile") is None
    assert {f.name: f.default for f in dataclasses.fields(BuildOptions)}["compile"] == flags.pop("compile")
    assert defaults == flags


def test_build_engine_then_llm_on_the_engine(tmp_path, llm2):
    """build_engine returns an engine directory; LLM runs it (auto: onnxruntime, no packages) with the checkpoint's
    greedy tokens. --compile none and small limits: the ONNX export alone (about 20 s on 2 cores)."""
    out = build_engine(TINY, tmp_path / "engine", compile="none", max_seq_len=128, max_batch=4, verbose=False)
    assert out == tmp_path / "engine" and (out / "config.json").is_file()
    llm = LLM(out)
    assert type(llm.engine.executor).__name__ == "OrtExecutor" and llm.engine.k == 2  # the built K
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in llm2.generate(PROMPTS, params)]


def test_build_engine_errors_are_the_builders(tmp_path):
    from builder.options import BuildError

    with pytest.raises(BuildError, match="backend"):
        build_engine(TINY, tmp_path / "engine", backend="nope")
    assert not (tmp_path / "engine").exists()


# ----------------------------------------------------------------------------------------------- behaviour
@pytest.fixture(scope="module")
def llm2() -> LLM:
    return LLM(TINY, executor="torch", num_draft_tokens=2)


@pytest.fixture(scope="module")
def llm0() -> LLM:
    return LLM(str(TINY), executor="torch", num_draft_tokens=0)


def test_greedy_is_lossless_and_equals_the_engine_loop(llm2, llm0):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    k2, k0 = llm2.generate(PROMPTS, params), llm0.generate(PROMPTS, params)
    engine = runtime.create_engine(checkpoint=TINY, executor="torch", num_draft_tokens=2)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    final = {out.req_id: out for out in engine.stream() if out.finished}
    direct = [final[i] for i in ids]
    assert [o.token_ids for o in k2] == [o.token_ids for o in k0] == [d.output_ids for d in direct]
    assert [o.text for o in k2] == [d.text for d in direct] and k2[0].text
    for out, prompt in zip(k2, PROMPTS, strict=True):
        assert isinstance(out, GenerationOutput) and out.prompt == prompt
        assert out.finish_reason in ("stop", "length") and out.error is None and out.logprobs is None
        assert len(out.accepted_per_step) == out.num_steps > 0 and out.num_proposed == 2 * out.num_steps
        assert out.mean_acceptance_length == pytest.approx(1 + sum(out.accepted_per_step) / out.num_steps)
    assert sum(sum(o.accepted_per_step) for o in k2) > 0  # the drafts were used, not just verified
    assert all(o.num_proposed == 0 and o.mean_acceptance_length == 1.0 and o.acceptance_rate == 0.0 for o in k0)
    assert llm2.last_summary is not None and llm2.last_summary["num_requests"] == len(PROMPTS)
    assert llm2.last_summary["executor"] == "torch"


def test_logprobs_when_asked_and_params_per_prompt(llm2):
    first, second = llm2.generate(["def main(", "class Foo:"], [SamplingParams(max_tokens=3),
                                                                 SamplingParams(max_tokens=5, logprobs=2)])  # fmt: skip
    assert (len(first.token_ids), len(second.token_ids)) == (3, 5)
    assert first.logprobs is None and first.prompt_logprobs is None
    assert second.logprobs is not None and [lp.token_id for lp in second.logprobs] == second.token_ids
    assert all(len(lp.top_ids) == 2 and lp.logprob <= 0.0 for lp in second.logprobs)
    (echo,) = llm2.generate("def main(", SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert echo.logprobs is None and echo.prompt_logprobs is not None and echo.prompt_logprobs[0] is None
    assert len(echo.prompt_logprobs) == len(llm2.engine.tokenizer.encode("def main(").ids)


def test_token_id_prompts(llm2):
    ids = llm2.engine.tokenizer.encode("def main(").ids
    params = SamplingParams(max_tokens=6)
    (text,) = llm2.generate("def main(", params)
    (flat,) = llm2.generate(ids, params)  # a flat list of ints is one prompt
    nested = llm2.generate([ids, [5, 6, 7, 8]], params)
    assert flat.prompt == ids and flat.token_ids == text.token_ids == nested[0].token_ids
    assert len(nested) == 2 and nested[1].prompt == [5, 6, 7, 8]
    assert llm2.generate([], params) == []


@pytest.mark.parametrize(("prompts", "params", "message"), [
    (["def main(", [1, 99999]], None, r"prompt 1: token ids \[99999\] are outside the vocabulary \[0, 2048\)"),
    (["def main(", ""], None, r"prompt 1: empty prompt"),
    ([b"def"], None, r"prompt 0: prompt is bytes"),
    (["a", "b"], [SamplingParams()], r"1 SamplingParams for 2 prompt\(s\)"),
    (["a", "b"], [SamplingParams(), SamplingParams(max_tokens=0)], r"prompt 1: max_tokens=0"),
    (7, None, r"prompts must be a str, a list of str or a list of token-id lists, got int"),
])  # fmt: skip
def test_rejected_prompt_is_one_line_and_runs_nothing(llm2, prompts, params, message):
    with pytest.raises(RequestError, match=f"^{message}") as info:
        llm2.generate(prompts, params)
    assert "\n" not in str(info.value)
    assert not llm2.engine.has_unfinished()  # the prompts added before the bad one were withdrawn
    (out,) = llm2.generate("def main(", SamplingParams(max_tokens=2))  # and the engine still serves
    assert len(out.token_ids) == 2


def test_no_progress_bar_off_a_terminal(llm2, capsys):
    llm2.generate(["a", "b", "c"], SamplingParams(max_tokens=2), use_tqdm=True)
    assert capsys.readouterr().err == ""


def test_model_path_picks_engine_or_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="does not exist: give an engine directory"):
        LLM(tmp_path / "missing")
    fake = tmp_path / "engine"  # an engine directory's config.json (schema_version + graphs), but no manifest
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"schema_version": 2, "graphs": []}))
    from models.engine_format import EngineDirError

    with pytest.raises(EngineDirError):  # loaded as an engine, refused by the engine loader
        LLM(fake)
    with pytest.raises(ConfigError, match="needs an engine directory"):  # a checkpoint: torch only
        LLM(TINY, executor="onnxruntime")
