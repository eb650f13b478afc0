"""Hypothesis strategies from JSON schemas as pydantic writes them: the OpenAPI document
the gateway serves (tests/test_openai_fuzz.py) and the TreePipeline manifest's schema
(tests/test_manifest_fuzz.py).  hypothesis-jsonschema would do this, but its releases
lag behind hypothesis's internals; pydantic's schemas use a small subset, covered here.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# a value as long as this shows every bug a longer one would, and keeps a run fast
MAX_TEXT = 12


def json_values(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value (small)."""
    scalars = (st.none() | st.booleans() | st.integers() | st.text(max_size=8)
               | st.floats(allow_nan=False, allow_infinity=False))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=max_leaves)


def from_schema(node: dict[str, Any], schemas: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid against ``node``; ``schemas`` holds what ``$ref``s name (by the last
    part of the reference: ``#/components/schemas/X`` or ``#/$defs/X``)."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(schemas[name], schemas))  # may recurse
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([from_schema(n, schemas) for n in node[key]])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "const" in node:
        return st.just(node["const"])
    kind = node.get("type")
    if kind is None:  # typed Any
        return json_values()
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = node.get("minimum"), node.get("maximum")
        if "exclusiveMinimum" in node:
            lo = node["exclusiveMinimum"] + 1
        if "exclusiveMaximum" in node:
            hi = node["exclusiveMaximum"] - 1
        return st.integers(lo, hi)
    if kind == "number":
        lo = node.get("minimum", node.get("exclusiveMinimum"))
        hi = node.get("maximum", node.get("exclusiveMaximum"))
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in node,
                         exclude_max="exclusiveMaximum" in node)
    if kind == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True).filter(
                lambda s: node.get("minLength", 0) <= len(s) <= node.get("maxLength", 1 << 30))
        lo = node.get("minLength", 0)
        return st.text(min_size=lo, max_size=max(lo, min(node.get("maxLength", MAX_TEXT),
                                                         MAX_TEXT)))
    if kind == "array":
        lo = node.get("minItems", 0)
        return st.lists(from_schema(node.get("items", {}), schemas), min_size=lo,
                        max_size=min(node.get("maxItems", lo + 3), lo + 3))
    if kind == "object":
        return objects(node, schemas)
    raise AssertionError(f"a schema type this module does not know: {kind}")


def objects(node: dict[str, Any], schemas: dict[str, Any],
            most: int | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Objects of ``node``: its required fields, and any of its optional ones (at most
    ``most`` of them: a body with every optional field is refused by one of them)."""
    props = node.get("properties", {})
    if not props:
        if "patternProperties" in node:
            (pattern, value), = node["patternProperties"].items()
            return st.dictionaries(st.from_regex(pattern, fullmatch=True),
                                   from_schema(value, schemas), max_size=3)
        values = node.get("additionalProperties")
        return st.dictionaries(st.text(max_size=6), from_schema(values, schemas)
                               if isinstance(values, dict) else json_values(), max_size=3)
    required = sorted(set(node.get("required", ())))
    fixed = st.fixed_dictionaries({k: from_schema(props[k], schemas) for k in required})
    optional = sorted(set(props) - set(required))
    if not optional:
        return fixed
    if most is None:
        return st.tuples(fixed, st.fixed_dictionaries(
            {}, optional={k: from_schema(props[k], schemas) for k in optional})).map(
            lambda t: {**t[0], **t[1]})

    @st.composite
    def some(draw: st.DrawFn) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(optional), max_size=most, unique=True))
        return {**draw(fixed), **{k: draw(from_schema(props[k], schemas)) for k in names}}

    return some()
