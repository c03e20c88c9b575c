"""Structured output requests: `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_grammar` (EBNF) and `guided_choice`, compiled to a runtime.core.grammar.Grammar.

At most one constraint per request. Compiling runs off the event loop (xgrammar caches compiled grammars, so
a schema sent again compiles once). The engine applies the grammar (runtime/core/grammar.py), with MTP too.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from runtime.core.grammar import DEFAULT_GRAMMAR_CACHE_BYTES, Grammar, GrammarCompiler, GrammarError
from runtime.serving.openai.protocol import ProtocolError


def constraint_of(req: Any) -> tuple[str, str, Any] | None:
    """(field name, kind, argument) of the request's one output constraint, or None."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", None))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ProtocolError("response_format json_schema needs json_schema.schema (a JSON Schema object)",
                                "response_format.json_schema")  # fmt: skip
        found.append(("response_format", "json_schema", rf.json_schema.schema_))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                       ("guided_choice", "choice")):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value))
    if len(found) > 1:
        raise ProtocolError(f"{found[0][0]} and {found[1][0]} both constrain the output: send one", found[1][0])
    if found and found[0][2] is not None and not found[0][2] and found[0][1] != "json_schema":
        raise ProtocolError(f"{found[0][0]} is empty", found[0][0])
    if found and found[0][1] == "choice" and not all(found[0][2] or ()):
        raise ProtocolError("guided_choice has an empty string: every choice needs at least one character",
                            "guided_choice")  # fmt: skip
    return found[0] if found else None


class Structured:
    """The server's grammar compiler, made on the first structured request (it needs the tokenizer)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_limit_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:  # fmt: skip
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.cache_limit_bytes = cache_limit_bytes
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # compiles run on worker threads; one compiler, made once

    def _compile(self, kind: str, arg: Any) -> Grammar:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids,
                                                 self.cache_limit_bytes)
            c = self._compiler
        if kind == "json_object":
            return c.json_object()
        if kind == "json_schema":
            return c.json_schema(arg)
        if kind == "regex":
            return c.regex(arg)
        if kind == "grammar":
            return c.ebnf(arg)
        return c.choice(arg)

    async def grammar_of(self, req: Any) -> Grammar | None:
        found = constraint_of(req)
        if found is None:
            return None
        name, kind, arg = found
        if self.tokenizer is None:
            raise ProtocolError(f"{name}: structured output needs the model's tokenizer (tokenizer.json)", name)
        try:
            return await asyncio.to_thread(self._compile, kind, arg)
        except GrammarError as e:
            raise ProtocolError(f"{name}: {e}", name) from None
