"""runtime/core/schema_support.py against the installed xgrammar: every keyword and format the check accepts is
enforced by the compiled grammar (a violating value is refused by the matcher), and every refused example is still
one the grammar would let through (so when xgrammar learns a keyword, this fails and the table can grow). The
grammars are compiled against an empty vocabulary and matched as strings: no model, milliseconds each."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from runtime.core.schema_support import ENFORCED, FORMATS, XGRAMMAR_VERSION_CHECKED, unsupported_keyword

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# (schema, a value it allows, a value it forbids): together they use every keyword of ENFORCED and every format.
SUPPORTED: list[tuple[dict, Any, Any]] = [
    ({"type": "integer", "minimum": 2, "maximum": 5}, 5, 6),
    ({"type": "integer", "minimum": 2, "maximum": 5}, 2, 1),
    ({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 5}, 3, 2),
    ({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 5}, 4, 5),
    ({"type": "integer", "multipleOf": 3}, 9, 4),
    ({"type": "integer", "multipleOf": 1000}, 2000, 1500),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 1000}, 994, 995),
    ({"type": "number", "minimum": -1.5, "maximum": 2.5}, 2.5, 2.6),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5, 1),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "a"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "abc", "ab1"),
    ({"type": "boolean"}, True, 1),
    ({"type": "null"}, None, 0),
    ({"type": ["integer", "null"], "maximum": 3}, None, 4),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1, 2], [1, 2, 3]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1], []),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ["a", 1], [1, 1]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, [1], [1, 2]),
    ({**OBJ, "required": ["a"], "additionalProperties": False}, {"a": 1}, {"b": 1}),
    ({**OBJ, "additionalProperties": {"type": "string"}}, {"a": 1, "c": "x"}, {"a": 1, "c": 2}),
    ({**OBJ, "unevaluatedProperties": {"type": "string"}}, {"a": 1, "c": "x"}, {"a": 1, "c": 2}),
    ({**OBJ, "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1}),
    ({**OBJ, "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ({"type": "object", "patternProperties": {"x[0-9]": {"type": "integer"}}}, {"x1": 1}, {"x1": "s"}),
    ({"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}}, {"ab": 1},
     {"abc": 1}),
    ({"type": "object", "properties": {"c": {"$ref": "#"}}}, {"c": {}}, {"c": 1}),  # recursion through a property
    ({"$defs": {"small": {"type": "integer", "maximum": 3}}, "type": "array", "items": {"$ref": "#/$defs/small"}},
     [3], [4]),
    ({"const": "x", "type": "string"}, "x", "y"),
    ({"type": "string", "enum": ["x", "y"]}, "y", "z"),
    ({"anyOf": [{"type": "integer", "maximum": 3}, {"type": "null"}], "default": None}, None, 4),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "s", True),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "cat"}, "a": {"type": "integer"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "dog"}, "b": {"type": "integer"}}, "required": ["k"]}],
      "discriminator": {"propertyName": "k"}}, {"k": "dog", "b": 1}, {"k": "dog", "a": 1}),
    ({"allOf": [{"type": "integer", "maximum": 3}]}, 3, 4),
]  # fmt: skip
FORMAT_VALUES = {"email": ("a@b.co", "a.b.co"), "date": ("2020-01-02", "2020-13-02"), "time": ("12:00:00Z", "25:00"),
                 "date-time": ("2020-01-02T03:04:05Z", "2020-01-02"), "duration": ("P1D", "1D"),
                 "ipv4": ("1.2.3.4", "1.2.3"), "ipv6": ("::1", "1.2.3.4"), "hostname": ("a.b", "a b"),
                 "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567"), "uri": ("http://a.b/c", "a b"),
                 "uri-reference": ("/a", "a b"), "uri-template": ("/a/{b}", "/a/{"), "json-pointer": ("/a", "a"),
                 "relative-json-pointer": ("0/a", "/a")}  # fmt: skip
SUPPORTED += [({"type": "string", "format": f}, good, bad) for f, (good, bad) in FORMAT_VALUES.items()]

# (schema, refused keyword, its path, a value breaking the schema that the grammar still allows)
REFUSED: list[tuple[dict, str, str, Any]] = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#", [1, 1]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains", "#", [1]),
    ({"type": "integer", "not": {"const": 3}}, "not", "#", 3),
    ({"not": {}}, "not", "#", 3),
    ({**OBJ, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "if", "#", {"a": 1}),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#", {"a": 1}),
    ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "#", {"a": 1}),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, "allOf", "#", 9),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf", "#", 3),
    ({"type": "integer", "allOf": [{"maximum": 5}]}, "type", "#", 9),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", "#", "abcdef"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "minLength", "#", "a"),
    ({"type": "string", "format": "email", "maxLength": 3}, "maxLength", "#", "a@b.co"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "pattern", "#", "b@b.co"),
    ({"type": "string", "format": "iri"}, "format", "#", "nope"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "#", 4),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100000}, "multipleOf", "#", 4),
    ({"type": "integer", "multipleOf": 100000}, "multipleOf", "#", 4),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#", 0.3),
    ({"type": "object", "properties": {"xa": {"type": "integer"}}, "patternProperties": {"x.*": {"minimum": 0}}},
     "patternProperties", "#", {"xa": -1}),
    ({"type": "object", "properties": {"LONG": {"type": "integer"}}, "propertyNames": {"pattern": "^[a-z]+$"}},
     "propertyNames", "#", {"LONG": 1}),
    ({"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}}, "required", "#", {}),
    ({"type": "object", "properties": {"a": {"type": "string", "anyOf": [{"maxLength": 1}, {"minLength": 5}]}}},
     "type", "#/properties/a", {"a": 3}),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "#", 3),
    ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "maximum": 3}, "maximum", "#", 9),
    ({"const": 1, "type": "string"}, "type", "#", 1),
    ({"type": "string", "enum": ["a", "b"], "maxLength": 0}, "maxLength", "#", "a"),
    ({"$ref": "http://example.com/schema"}, "$ref", "#", 1),
    ({"minimum": 3}, "minimum", "#", 1),
    ({"type": []}, "type", "#", 1),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "#", "!"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}},
      "$defs": {"tag": {"type": "string", "not": {"const": ""}}}}, "not", "#/$defs/tag", {"tags": [""]}),
]  # fmt: skip
NOTHING = object()  # the grammar admits no value at all: the engine would fail the request mid-generation
REFUSED += [({"$ref": "#"}, "$ref", "#", NOTHING),
            ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
             "$ref", "#/$defs/b", NOTHING)]  # fmt: skip

_compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)


def _accepts(schema: dict, value: Any) -> bool:
    """Does the grammar the server would compile (runtime/core/grammar.py: strict, no free whitespace) match it?"""
    grammar = _compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return matcher.accept_string(json.dumps(value)) and matcher.is_terminated()


def _keywords(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_keywords, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    named = [v for k in ("properties", "$defs") for v in (node.get(k) or {}).values()]  # names, then schemas
    values = [v for k, v in node.items() if k not in ("properties", "$defs", "enum", "const")]
    return set(node).union(*map(_keywords, named + values))


def test_the_table_was_checked_against_the_installed_xgrammar():
    from importlib.metadata import version

    assert version("xgrammar") == XGRAMMAR_VERSION_CHECKED, "re-check runtime/core/schema_support.py's tables"


def test_the_cases_cover_every_supported_keyword_and_format():
    used = set().union(*(_keywords(s) for s, _, _ in SUPPORTED))
    assert set().union(*ENFORCED.values()) | {"type", "$ref", "const", "enum", "anyOf", "oneOf", "allOf"} <= used
    assert {s.get("format") for s, _, _ in SUPPORTED} >= FORMATS


def _id(x: Any) -> str:
    return json.dumps(x)[:60] if isinstance(x, dict) else ""


@pytest.mark.parametrize("schema, good, bad", SUPPORTED, ids=_id)
def test_every_accepted_keyword_is_enforced(schema, good, bad):
    assert unsupported_keyword(schema) is None
    assert unsupported_keyword(json.dumps(schema)) is None  # guided_json may be JSON text
    assert _accepts(schema, good), f"the grammar refuses a valid value {good!r}"
    assert not _accepts(schema, bad), f"the grammar lets {bad!r} through"


@pytest.mark.parametrize("schema, keyword, path, slips", REFUSED, ids=_id)
def test_every_refused_schema_names_its_keyword_and_would_slip_through(schema, keyword, path, slips):
    found = unsupported_keyword(schema)
    assert found is not None and (found.keyword, found.path) == (keyword, path), found
    assert f"`{keyword}` at {path}" in found.message and "\n" not in found.message
    if slips is NOTHING:
        assert not any(_accepts(schema, v) for v in (0, "", None, {}, [], True))
    else:
        assert _accepts(schema, slips), "xgrammar enforces this now: move it to the supported table"


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {}}, "required": [{}]}, {"format": []},
                                    {"type": "string", "format": ["email"]}, {"type": [1]}, {"enum": {}},
                                    {"oneOf": [{"type": [[]]}, {"enum": 3}]}, {"$ref": 5}, {"$ref": "#/nope"}, []])  # fmt: skip
def test_a_malformed_schema_gets_an_answer_not_an_exception(schema):
    found = unsupported_keyword(schema)
    assert found is None or found.message  # left to the compiler (a 400 of its own) or refused by name


def test_a_schema_nested_too_deep_is_refused_not_a_crash():
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    found = unsupported_keyword(deep)
    assert found is not None and "nests too deeply" in found.message
