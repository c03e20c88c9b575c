"""Structured output requests: `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_grammar` (EBNF) and `guided_choice`, compiled to a runtime.core.grammar.Grammar.

At most one constraint per request. Compiling runs off the event loop on a pool of its own (COMPILE_THREADS), so
a slow compile never holds the default pool that tokenizes plain requests: a 67 KB schema took 29 s to compile,
and eight at once made a grammar-free request wait 396 s. A constraint over `max_bytes` is a 400 naming the limit
before anything compiles, and so is a schema keyword the grammar would not enforce (runtime/core/schema_support.py:
never relaxed silently); a compile that runs past `timeout_s` is a 400 (the schema is too complex), one that
could not start within it a 503 (the compilers are busy); more than MAX_PENDING waiting is a 429. xgrammar caches
compiled grammars (within a byte budget), so a schema sent again compiles once. The engine applies the grammar
(runtime/core/grammar.py), with MTP too.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime.core.grammar import DEFAULT_GRAMMAR_CACHE_BYTES, Grammar, GrammarCompiler, GrammarError
from runtime.core.schema_support import unsupported_keyword
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


COMPILE_THREADS = 2  # compiles in parallel; the rest wait (each is one CPU-bound thread)
MAX_PENDING = 16  # compiles running or waiting before a 429
DEFAULT_MAX_BYTES = 32 << 10  # a constraint's size (the schema's JSON, the regex, the EBNF)
DEFAULT_TIMEOUT_S = 10.0  # a compile's time, queueing included


class Structured:
    """The server's grammar compiler, made on the first structured request (it needs the tokenizer)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_limit_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:  # fmt: skip
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.cache_limit_bytes, self.max_bytes, self.timeout_s = cache_limit_bytes, max_bytes, timeout_s
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._pending = 0  # compiles submitted and not finished (event loop only)
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
        size = len(arg.encode() if isinstance(arg, str) else json.dumps(arg).encode()) if arg is not None else 0
        if size > self.max_bytes:
            raise ProtocolError(f"{name} is {size} bytes, over this server's {self.max_bytes} (--grammar-max-bytes)",
                                name)  # fmt: skip
        unsupported = unsupported_keyword(arg) if kind == "json_schema" else None
        if unsupported is not None:  # what the grammar would not enforce is refused, never silently relaxed
            raise ProtocolError(f"{name}: {unsupported.message}", name)
        if self._pending >= MAX_PENDING:
            raise ProtocolError(f"{name}: {self._pending} grammars are compiling; retry later", name, status=429)
        started: list[float] = []

        def compile_timed() -> Grammar:
            started.append(time.monotonic())
            return self._compile(kind, arg)

        self._pending += 1
        job = asyncio.get_running_loop().run_in_executor(self._pool, compile_timed)
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.timeout_s)
        except GrammarError as e:
            raise ProtocolError(f"{name}: {e}", name) from None
        except TimeoutError:
            if not started:  # it waited for the compilers the whole time: not this request's doing
                raise ProtocolError(f"{name}: the grammar compilers are busy; retry later", name, status=503) from None
            raise ProtocolError(f"{name}: compiling it took longer than {self.timeout_s:g} s "
                                "(--grammar-compile-timeout): simplify the schema", name) from None  # fmt: skip
        finally:
            job.add_done_callback(lambda _: self._done())

    def _done(self) -> None:
        self._pending -= 1
