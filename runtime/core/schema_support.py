"""Which JSON Schema keywords structured output enforces, and the one check that refuses the rest.

xgrammar compiles a JSON schema to a grammar, but it drops what it cannot express with a log warning only
(`uniqueItems`, `contains`, `not`, `if`/`then`/`else`, `dependentRequired`, multi-schema `allOf`, ...), and some
keywords it drops without a word: `maxLength` beside `pattern`, everything beside a `$ref`, `anyOf` or `const`, a
`multipleOf` over a wide range, an unknown `format`, `{"not": {}}`. A request under such a schema got outputs that
broke it, with finish_reason "stop". `unsupported_keyword` walks a schema (through its local `$ref`s) and returns
the first keyword the grammar would not hold the output to, with its JSON pointer, so the server refuses the request
(400) before anything compiles; nothing is relaxed silently. Keywords that constrain only other JSON types than the
schema allows are no-ops in JSON Schema too, and pass.

The tables below are the one statement of what is enforced. Checked against xgrammar 0.2.8 (requirements.lock), by
reading its converter (cpp/json_schema_converter.cc: SchemaParser::Parse's dispatch order, ParseString, ParseInteger,
ParseArray, ParseObject) and by compiling: tests/runtime/test_schema_support.py compiles a case for every keyword
and format accepted here and checks that the grammar refuses a violating value, and that each refused example still
lets one through (so the test fails when xgrammar learns a keyword and this table should grow).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

XGRAMMAR_VERSION_CHECKED = "0.2.8"

# Keywords that never constrain a value (or only name schemas for $ref): accepted anywhere.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                         "$comment", "$schema", "$defs", "definitions", "discriminator"})  # fmt: skip

# The JSON types each type-specific keyword constrains (JSON Schema 2020-12); on any other type it is a no-op.
APPLIES_TO: dict[str, frozenset[str]] = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    frozenset({"integer", "number"})),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), frozenset({"string"})),
    **dict.fromkeys(("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems", "contains",
                     "minContains", "maxContains"), frozenset({"array"})),
    **dict.fromkeys(("properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
                     "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
                     "dependencies"), frozenset({"object"})),
}  # fmt: skip

# What the grammar enforces per type (with the conditions in _typed_keyword); any other keyword is refused.
ENFORCED: dict[str, frozenset[str]] = {
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "boolean": frozenset(),
    "null": frozenset(),
    "array": frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "unevaluatedProperties",
                         "patternProperties", "propertyNames", "minProperties", "maxProperties"}),
}  # fmt: skip

# The string formats xgrammar turns into a regex; any other format it ignores.
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})  # fmt: skip

# integer multipleOf: xgrammar enforces it alone or within both bounds, up to a divisor and a range width it
# drops it past (between 1,000 and 10,000 in 0.2.8); these bounds stay under both.
MULTIPLE_OF_MAX = 1000
MULTIPLE_OF_RANGE_MAX = 1000

_SUBSCHEMA_KEYS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # xgrammar's dispatch order, before "type"


@dataclass(frozen=True)
class Unsupported:
    keyword: str
    path: str  # JSON pointer of the schema holding the keyword, "#" for the root
    why: str

    @property
    def message(self) -> str:
        return (f"`{self.keyword}` at {self.path} is not enforced by structured output ({self.why}); the output would "
                "not be held to it: remove it or rewrite the schema (docs/SERVING.md lists what is supported)")


class _Refused(Exception):
    def __init__(self, found: Unsupported) -> None:
        self.found = found


def unsupported_keyword(schema: Any) -> Unsupported | None:
    """The first keyword of `schema` (a dict, or its JSON text) that the grammar would not enforce, or None."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None  # not JSON: the compiler says so
    walker = _Walker(schema)
    try:
        walker.walk(schema, "#", "#")
        walker.check_cycles()
    except _Refused as e:
        return e.found
    except RecursionError:
        return Unsupported("(nesting)", "#", "the schema nests too deeply")
    return None


def _ptr(path: str, *parts: Any) -> str:
    return "/".join([path, *(str(p).replace("~", "~0").replace("/", "~1") for p in parts)])


def _dict(s: dict, key: str) -> dict:
    return s[key] if isinstance(s.get(key), dict) else {}


def _list(s: dict, key: str) -> list:
    return s[key] if isinstance(s.get(key), list) else []


def _type_names(s: dict) -> set[str]:
    t = s.get("type")
    return {t} if isinstance(t, str) else {x for x in _list(s, "type") if isinstance(x, str)}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "?")


def _matches(value: Any, types: set[str]) -> bool:
    t = _json_type(value)
    return t in types or (t == "integer" and "number" in types)


class _Walker:
    """Walks every subschema the grammar would compile, once per `$ref` region, refusing what it cannot enforce."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.done: set[tuple[str, str | None]] = set()
        # $ref edges taken without matching any character in between (region -> target, site of the $ref): a
        # cycle of them is a grammar that admits nothing ({"$ref": "#"}), or a left recursion
        self.edges: dict[str, list[tuple[str, str]]] = {}

    def refuse(self, keyword: str, path: str, why: str) -> NoReturn:
        raise _Refused(Unsupported(keyword, path, why))

    def resolve(self, ref: Any, path: str) -> tuple[Any, str]:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            self.refuse("$ref", path, f"only local references (#/...) are resolved, not {ref!r}")
        node = self.root
        for raw in [p for p in ref[2:].split("/") if p]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                self.refuse("$ref", path, f"{ref!r} does not resolve")
        return node, ref

    def walk(self, s: Any, path: str, region: str | None, default_type: str | None = None) -> None:
        """`region`: the $ref target (or root) this subschema is reached from without consuming input, or None."""
        if isinstance(s, bool) or not isinstance(s, dict) or (path, region) in self.done:
            return  # true / false / not a schema: the compiler accepts or refuses it itself
        self.done.add((path, region))
        keys = set(s) - ANNOTATIONS - ({"$id"} if path == "#" else set())
        head = next((k for k in _SUBSCHEMA_KEYS if k in s), None)
        if head is not None:
            self.walk_head(s, head, keys, path, region)
            return
        types = self.types_of(s, path, default_type)
        for k in sorted(keys - {"type"}, key=list(s).index):
            self.typed_keyword(s, k, types, path)
        self.walk_children(s, types, path)

    def walk_head(self, s: dict, head: str, keys: set[str], path: str, region: str | None) -> None:
        """$ref, const, enum, anyOf, oneOf, allOf: xgrammar reads that keyword alone and ignores its siblings."""
        allowed = {head}
        if head in ("const", "enum") and "type" in s:  # a type the values all have restates them (pydantic's Literal)
            values = self.const_values(s) or []
            types = _type_names(s)
            if not all(_matches(v, types) for v in values):
                self.refuse("type", path, f"a value of `{head}` is not of this type")
            allowed.add("type")
        for k in sorted(keys - allowed, key=list(s).index):
            self.refuse(k, path, f"it is ignored beside `{head}`; put it inside the `{head}` schema(s)")
        if head == "$ref":
            target, ref = self.resolve(s["$ref"], path)
            if region is not None:
                self.edges.setdefault(region, []).append((ref, path))
            self.walk(target, ref, ref)
            return
        if head in ("const", "enum"):
            return
        branches = s[head] if isinstance(s[head], list) else None
        if not branches:
            if branches is not None:
                self.refuse(head, path, "it is empty")
            return  # not a list: the compiler refuses it
        if head == "allOf" and len(branches) > 1:
            self.refuse("allOf", path, "only an allOf of one schema is applied; merge the schemas into one")
        if head == "oneOf" and not self.disjoint(branches, path):
            self.refuse("oneOf", path, "its branches may overlap and a value matching two would pass (it is read as "
                                       "anyOf); use anyOf, or make the branches differ in type or in a required const")
        for i, b in enumerate(branches):
            self.walk(b, _ptr(path, head, i), region)

    def types_of(self, s: dict, path: str, default_type: str | None) -> set[str]:
        t = s.get("type", default_type)
        if isinstance(t, list):
            if not t:
                self.refuse("type", path, "an empty type list is read as any type")
            return {x for x in t if isinstance(x, str)}
        if isinstance(t, str):
            return {t}
        if {"properties", "additionalProperties", "unevaluatedProperties"} & set(s):
            return {"object"}  # xgrammar reads these as an object schema
        if {"items", "prefixItems", "unevaluatedItems"} & set(s):
            return {"array"}
        return set(ENFORCED)  # no type: any value, and the grammar applies no type-specific keyword at all

    def typed_keyword(self, s: dict, k: str, types: set[str], path: str) -> None:
        applies = APPLIES_TO.get(k)
        if applies is None:
            self.refuse(k, path, "the grammar compiler ignores it")
        if "type" not in s and types == set(ENFORCED):
            self.refuse(k, path, "without a `type` the grammar allows any value; add one")
        for t in sorted(applies & types):
            if k not in ENFORCED[t]:
                self.refuse(k, path, f"the grammar compiler ignores it for type {t}")
            self.condition(s, k, t, path)

    def condition(self, s: dict, k: str, t: str, path: str) -> None:
        """The combinations xgrammar drops a keyword in."""
        if k in ("minLength", "maxLength") and ({"pattern", "format"} & set(s)):
            self.refuse(k, path, f"it is ignored beside `{'pattern' if 'pattern' in s else 'format'}`; "
                                 "write the length into the pattern")  # fmt: skip
        elif k == "pattern" and "format" in s:
            self.refuse(k, path, "it is ignored beside `format`")
        elif k == "format" and not (isinstance(s[k], str) and s[k] in FORMATS):
            self.refuse(k, path, f"format {s[k]!r} is not one of {', '.join(sorted(FORMATS))}")
        elif k == "multipleOf" and t == "integer":
            m = s[k]
            if not (isinstance(m, (int, float)) and not isinstance(m, bool) and float(m).is_integer()
                    and 0 < m <= MULTIPLE_OF_MAX):  # fmt: skip
                self.refuse(k, path, f"an integer's multipleOf must be a whole number in 1..{MULTIPLE_OF_MAX}")
            low = [s[b] for b in ("minimum", "exclusiveMinimum") if b in s]
            high = [s[b] for b in ("maximum", "exclusiveMaximum") if b in s]
            if (low or high) and not (low and high and all(isinstance(x, (int, float)) for x in low + high)
                                      and max(high) - min(low) <= MULTIPLE_OF_RANGE_MAX):  # fmt: skip
                self.refuse(k, path, "beside a bound it needs both bounds, at most "
                                     f"{MULTIPLE_OF_RANGE_MAX} apart")  # fmt: skip
        elif k == "multipleOf":  # type number
            self.refuse(k, path, "the grammar compiler ignores it for type number; use type integer")
        elif k == "patternProperties":
            if "properties" in s:
                self.refuse(k, path, "a property named in `properties` is not checked against the patterns")
            if isinstance(s[k], dict) and len(s[k]) > 1:
                self.refuse(k, path, "a name matching two patterns is held to one only; use one pattern")
        elif k == "required" and isinstance(s[k], list):
            missing = [n for n in s[k] if not isinstance(n, str) or n not in _dict(s, "properties")]
            if missing:
                self.refuse(k, path, f"{missing[0]!r} is not in `properties`; the grammar requires only those")
        elif k == "propertyNames" and ({"properties", "patternProperties"} & set(s)):
            self.refuse(k, path, "it only applies to additionalProperties' names")

    def walk_children(self, s: dict, types: set[str], path: str) -> None:
        """The subschemas xgrammar compiles; each one matches some characters first, so regions end here."""
        if "object" in types:
            for key in ("properties", "patternProperties"):
                for name, sub in _dict(s, key).items():
                    self.walk(sub, _ptr(path, key, name), None)
            self.walk(s.get("additionalProperties"), _ptr(path, "additionalProperties"), None)
            if "additionalProperties" not in s:  # beside it, every property is evaluated: unevaluated* is a no-op
                self.walk(s.get("unevaluatedProperties"), _ptr(path, "unevaluatedProperties"), None)
            self.walk(s.get("propertyNames"), _ptr(path, "propertyNames"), None, default_type="string")
        if "array" in types:
            for i, sub in enumerate(_list(s, "prefixItems")):
                self.walk(sub, _ptr(path, "prefixItems", i), None)
            self.walk(s.get("items"), _ptr(path, "items"), None)
            if "items" not in s:
                self.walk(s.get("unevaluatedItems"), _ptr(path, "unevaluatedItems"), None)

    def disjoint(self, branches: list, path: str) -> bool:
        """True when no value can match two branches: they allow different JSON types, or they are objects that
        all require one property whose const / enum values differ (a discriminated union)."""
        resolved = [self.deref(b, path) for b in branches]
        type_sets = [self.value_types(b) for b in resolved]
        if all(type_sets):
            seen: set[str] = set()
            for ts in type_sets:
                if seen & ts:
                    break
                seen |= ts
            else:
                return True
        if not all(isinstance(b, dict) and b.get("type") == "object" for b in resolved):
            return False
        common = set.intersection(*({n for n in _list(b, "required") if isinstance(n, str)} for b in resolved))
        for name in sorted(common):
            values = [self.const_values(self.deref(_dict(b, "properties").get(name), path)) for b in resolved]
            if all(v is not None for v in values):
                flat = [json.dumps(x, sort_keys=True) for v in values for x in v]  # type: ignore[union-attr]
                if len(flat) == len(set(flat)):
                    return True
        return False

    def deref(self, s: Any, path: str) -> Any:
        for _ in range(32):
            if not (isinstance(s, dict) and "$ref" in s):
                return s
            s, _ref = self.resolve(s["$ref"], path)
        return s

    def value_types(self, s: Any) -> set[str]:
        """The JSON types a branch can match, widened (integer and number overlap), or empty when unknown."""
        if not isinstance(s, dict):
            return set()
        values = self.const_values(s)
        types = {_json_type(v) for v in values} if values is not None else _type_names(s)
        return types | {"number"} if types & {"integer", "number"} else types

    @staticmethod
    def const_values(s: Any) -> list | None:
        if isinstance(s, dict) and "const" in s:
            return [s["const"]]
        if isinstance(s, dict) and isinstance(s.get("enum"), list):
            return list(s["enum"])
        return None

    def check_cycles(self) -> None:
        """A cycle of $refs that match nothing in between: the grammar admits no value (or loops)."""
        state: dict[str, int] = {}  # 1 on the DFS stack, 2 finished

        def visit(node: str) -> None:
            state[node] = 1
            for target, site in self.edges.get(node, ()):
                if state.get(target) == 1:
                    self.refuse("$ref", site, f"it refers back to {target} without matching anything in between, "
                                              "so no value matches")  # fmt: skip
                if target not in state:
                    visit(target)
            state[node] = 2

        for start in list(self.edges):
            if start not in state:
                visit(start)
