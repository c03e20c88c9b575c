"""Structured output: a per-request grammar (xgrammar) that masks the main model's sampling and the drafts.

With MTP the grammar has to hold at every position a step may emit, not only at the next one:
  draft   depth d's logits are masked by the matcher's state after d_0..d_{d-1}, so every draft is valid;
          a draft the matcher still rejects (the grammar already ended) is cut before it is verified.
  verify  row i of the verify logits is masked by the state after d_0..d_{i-1}: the main model's choice at
          every verified position is one the grammar allows, exactly as with MTP off at that position.
  emit    the emitted tokens (accepted drafts + the main token) advance the matcher; the drafts' temporary
          advance is rolled back first, so the matcher always sits at the last emitted token.
Greedy output under a grammar is therefore token-identical with MTP on and off.

The engine calls `mask_verify_rows`, `advance`, `mask_draft`, `push_draft` and `end_drafts`; each returns
at once for a request without a grammar. Compiling (GrammarCompiler) happens in the frontend, off the
engine thread; the engine only runs matchers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.core.schema_support import unsupported_keyword

if TYPE_CHECKING:
    from runtime.core.request import Request


class GrammarError(ValueError):
    """A grammar / schema / regex that does not compile: a bad request (400)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar; each request gets its own matcher."""

    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    kind: str  # json_schema | json_object | regex | grammar | choice (reporting only)

    def new_matcher(self) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


# The byte budget of xgrammar's compiled-grammar cache (its default, -1, is unbounded: 1,600 distinct 4.5 KB
# schemas grew a server from 621 to 1,509 MiB with no plateau). vLLM's default is 512 MiB too.
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20


class GrammarCompiler:
    """Compiles request grammars against one tokenizer; xgrammar caches compiled grammars itself, least recently
    used first out past `cache_limit_bytes` (-1: no bound)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_limit_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:  # fmt: skip
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._xgr, self.vocab_size = xgr, vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_limit_bytes)

    @property
    def cache_size_bytes(self) -> int:
        return int(self._compiler.get_cache_size_bytes())

    def _compile(self, kind: str, fn, *args, **kwargs) -> Grammar:
        try:
            return Grammar(fn(*args, **kwargs), self.vocab_size, kind)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with a message
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)  # xgrammar's "[time] file.cc:line: " prefix
            raise GrammarError(f"{kind} does not compile: {first}") from None

    def json_schema(self, schema: dict | str, strict: bool = True) -> Grammar:
        unsupported = unsupported_keyword(schema)
        if unsupported is not None:  # xgrammar would drop it with a log warning and the output could break it
            raise GrammarError(f"json_schema: {unsupported.message}")
        text = schema if isinstance(schema, str) else json.dumps(schema)
        # no free whitespace: a model may otherwise emit whitespace until max_tokens and never close the object
        return self._compile("json_schema", self._compiler.compile_json_schema, text, any_whitespace=False,
                             strict_mode=strict)  # fmt: skip

    def json_object(self) -> Grammar:
        return self._compile("json_object", self._compiler.compile_json_schema, '{"type": "object"}',
                             any_whitespace=False)  # fmt: skip

    def regex(self, pattern: str) -> Grammar:
        return self._compile("regex", self._compiler.compile_regex, pattern)

    def ebnf(self, text: str) -> Grammar:
        return self._compile("grammar", self._compiler.compile_grammar, text)

    def choice(self, options: Sequence[str]) -> Grammar:
        rule = " | ".join(json.dumps(o) for o in options)
        return self._compile("choice", self._compiler.compile_grammar, f"root ::= {rule}")


@dataclass(slots=True)
class _State:
    matcher: Any
    drafted: int = 0  # drafts the matcher accepted in this draft loop (rolled back at its end)
    cut: int | None = None  # the first draft the matcher rejected


def _state(req: Request) -> _State:
    if req.matcher is None:
        req.matcher = _State(req.params.grammar.new_matcher())
    return req.matcher


def _allowed(matcher: Any, vocab_size: int) -> np.ndarray:
    """bool [V]: the tokens the matcher accepts next."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def _masked(rows: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed[None, : rows.shape[1]], rows, -np.inf).astype(rows.dtype)


# ---------------------------------------------------------------------------------------------- engine hooks
def mask_verify_rows(req: Request, rows: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
    """rows [1+k, V] -> the same with every token the grammar forbids at that row's position at -inf."""
    if req.params.grammar is None:
        return rows
    st, vocab = _state(req), req.params.grammar.vocab_size
    out = rows.copy()
    advanced = 0
    for i in range(len(rows)):
        out[i : i + 1] = _masked(rows[i : i + 1], _allowed(st.matcher, vocab))
        if i == len(rows) - 1 or i >= len(drafts) or not st.matcher.accept_token(int(drafts[i])):
            break  # later rows are unreachable: the main model cannot pick a draft the grammar forbids
        advanced += 1
        if st.matcher.is_terminated():
            break  # the draft was a stop token: the request ends with it, later rows are never emitted
    if advanced:
        st.matcher.rollback(advanced)
    return out


def advance(req: Request, emitted: Sequence[int]) -> None:
    """The matcher takes this step's emitted tokens; one it refuses is a bug worth aborting the request for."""
    if req.params.grammar is None:
        return
    st = _state(req)
    for t in emitted:
        if st.matcher.is_terminated():
            return  # the grammar ended on a stop token: the request stops there too
        if not st.matcher.accept_token(int(t)):
            raise RuntimeError(f"the grammar refused emitted token {t}")


def mask_draft(req: Request, logits: np.ndarray) -> np.ndarray:
    """A draft depth's logits [1, V], masked by the state after the drafts already made this loop."""
    if req.params.grammar is None:
        return logits
    st = _state(req)
    if st.cut is not None or st.matcher.is_terminated():
        return logits  # this draft is cut anyway
    return _masked(logits, _allowed(st.matcher, req.params.grammar.vocab_size))


def push_draft(req: Request, token: int) -> None:
    if req.params.grammar is None:
        return
    st = _state(req)
    if st.cut is None:
        if not st.matcher.is_terminated() and st.matcher.accept_token(int(token)):
            st.drafted += 1
        else:
            st.cut = st.drafted


def end_drafts(req: Request) -> None:
    """Roll the matcher back to the last emitted token and cut the drafts it rejected (and their probs)."""
    if req.params.grammar is None:
        return
    st = _state(req)
    if st.drafted:
        st.matcher.rollback(st.drafted)
    if st.cut is not None:
        del req.spec.drafts[st.cut :]
        if req.spec.draft_probs is not None:
            req.spec.draft_probs = req.spec.draft_probs[: st.cut] if st.cut else None
    st.drafted, st.cut = 0, None
