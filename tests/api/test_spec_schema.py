"""The job spec is described once (workers.config) and bounded by construction: a walk of the submit
request's JSON schema (what /openapi.json documents and pydantic enforces) fails on any number without a
maximum, any string without a maximum length (or a fixed set of values), any list or free-form mapping
without a maximum size, and any field that names a place but is not judged through the server's one
location table (service.server.admission.LOCATION_FIELDS). The schema is also checked to hide no field of
the spec, so that nothing escapes the walk."""

from __future__ import annotations

import dataclasses
import re
import typing

from api.schemas import JobSubmit
from service.server.admission import LOCATION_FIELDS
from workers.config import LOCATION, JobConfig

ALLOWED: dict[tuple[str, ...], str] = {
    # (request path, what the walk would say): why it is fine. At most five entries.
}
"""Fields the walk excuses, each with its reason (none today)."""

MAX_ALLOWED = 5
_LOOKS_LIKE_A_PLACE = re.compile(r"(^|_)(path|dir|from|root|url|uri|file|location)$")
_DESCRIBES_A_PLACE = re.compile(r"\b(path|directory|URL)\b", re.I)


def _schema() -> tuple[dict, dict]:
    s = JobSubmit.model_json_schema()
    return s, s.get("$defs", {})


def _alternatives(s: dict, defs: dict) -> list[dict]:
    while "$ref" in s:
        s = {**defs[s["$ref"].split("/")[-1]], **{k: v for k, v in s.items() if k != "$ref"}}
    if "anyOf" in s:
        return [a for x in s["anyOf"] for a in _alternatives({**{k: v for k, v in s.items() if k != "anyOf"}, **x}, defs)]
    return [s]


def walk() -> tuple[dict[tuple[str, ...], str], set[tuple[str, ...]], set[tuple[str, ...]]]:
    """(problems by field path, fields marked as places, string fields that look like places)."""
    schema, defs = _schema()
    problems: dict[tuple[str, ...], str] = {}
    marked: set[tuple[str, ...]] = set()
    looks: set[tuple[str, ...]] = set()

    def visit(s: dict, path: tuple[str, ...], seen: frozenset) -> None:
        for a in _alternatives(s, defs):
            kind = a.get("type")
            if kind in ("integer", "number"):
                if "maximum" not in a and "exclusiveMaximum" not in a:
                    problems[path] = f"a {kind} without a maximum"
            elif kind == "string":
                if "maxLength" not in a and "enum" not in a and "const" not in a:
                    problems[path] = "a string without a maximum length"
                if a.get("x-elastron-location"):
                    marked.add(path)
                elif "enum" not in a and "const" not in a and path and (
                        _LOOKS_LIKE_A_PLACE.search(str(path[-1])) or _DESCRIBES_A_PLACE.search(s.get("description", ""))):
                    looks.add(path)
            elif kind == "array":
                if "maxItems" not in a:
                    problems[path] = "a list without a maximum length"
                visit(a.get("items", {}), (*path, "[]"), seen)
            elif kind == "object" or "properties" in a:
                title = a.get("title")
                if title in seen:
                    continue
                for name, sub in a.get("properties", {}).items():
                    visit(sub, (*path, name), seen | {title})
                extra = a.get("additionalProperties")
                if isinstance(extra, dict) or extra is None and not a.get("properties"):
                    if "maxProperties" not in a:
                        problems[path] = "a mapping without a maximum size"
                    if "maxLength" not in a.get("propertyNames", {}):
                        problems[(*path, "{}")] = "a mapping whose keys have no maximum length"
                    if isinstance(extra, dict):
                        visit(extra, (*path, "{}"), seen)
            elif kind not in ("boolean", "null") and "enum" not in a and "const" not in a:
                problems[path] = f"a field of no bounded type ({a})"

    visit(schema, (), frozenset())
    return problems, marked, looks


def test_every_field_of_a_submit_request_is_bounded():
    problems, _, _ = walk()
    assert len(ALLOWED) <= MAX_ALLOWED
    unexcused = {p: why for p, why in problems.items() if p not in ALLOWED}
    assert not unexcused, f"bound these in workers.config (or excuse them in ALLOWED, with a reason): {unexcused}"
    assert not set(ALLOWED) - set(problems), "ALLOWED excuses a field that is bounded now"


def test_every_place_is_judged_through_the_location_table():
    _, marked, looks = walk()
    assert ("spec", "data", "path") in marked and ("run_dir",) in marked  # the walk sees them
    assert marked == set(LOCATION_FIELDS), (
        f"marked as places but not in admission's LOCATION_FIELDS: {sorted(marked - set(LOCATION_FIELDS))}; "
        f"in LOCATION_FIELDS but not a marked field of the request: {sorted(set(LOCATION_FIELDS) - marked)}")
    assert not looks - set(ALLOWED), (f"{sorted(looks)} look like paths: type them workers.config.Location (and "
                                      "add them to LOCATION_FIELDS), or excuse them in ALLOWED")
    assert LOCATION == {"x-elastron-location": True}


def test_the_schema_hides_no_field_of_the_spec():
    """Every field of every section is in the schema the walk reads: a field left out of the JSON schema
    would be enforced by nothing the walk can see."""
    schema, defs = _schema()

    def check(cls: type, s: dict, path: tuple[str, ...]) -> None:
        (a,) = [x for x in _alternatives(s, defs) if x.get("type") == "object" or "properties" in x]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name in a["properties"], f"{'.'.join((*path, f.name))} is missing from the schema"
            sub = next((t for t in typing.get_args(hints[f.name]) + (hints[f.name],) if dataclasses.is_dataclass(t)), None)
            if sub is not None:
                check(sub, a["properties"][f.name], (*path, f.name))

    check(JobConfig, schema["properties"]["spec"], ("spec",))
