"""Schema-driven fuzzing of the API (schemathesis over /openapi.json): requests generated from the schema,
valid ones and deliberately invalid ones, never get a 5xx, and valid ones get responses that match the
documented schema."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from api.app import create_app  # noqa: E402
from api.deps import Settings  # noqa: E402
from tests.api.helpers import SPEC, make_app, make_launcher, stop_all  # noqa: E402

# The operations, read from an app that is never started (create_app has no side effects). Invalid
# requests can only be made where some input has a shape to break (a body, a numeric query parameter;
# any string is a valid job id).
_PATHS = create_app(settings=Settings()).openapi()["paths"]
OPERATIONS = [f"{m.upper()} {p}" for p, ops in _PATHS.items() for m in ops]
CASES = [(f"{m.upper()} {p}", mode) for p, ops in _PATHS.items() for m, op in ops.items()
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or op.get("requestBody")
         or any(q["in"] == "query" for q in op.get("parameters", []))]


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    launcher, _ = make_launcher(nodes={})  # jobs that pass validation wait for capacity: cheap
    app = make_app(tmp_path_factory.mktemp("fuzz"), launcher)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    stop_all(launcher)


def test_every_operation_is_fuzzed():
    assert len(OPERATIONS) >= 14 and "POST /api/v1/jobs" in OPERATIONS


@pytest.mark.parametrize("label,mode", CASES, ids=[f"{lb} {m.value}" for lb, m in CASES])
def test_no_request_gets_a_server_error(api_schema, label, mode):
    op = api_schema.find_operation_by_label(label)
    checks = [not_a_server_error] + ([response_schema_conformance] if mode is GenerationMode.POSITIVE else [])
    seen = []

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        response = case.call()
        seen.append(response.status_code)
        case.validate_response(response, checks=checks)

    run()
    assert seen and max(seen) < 500


# -- with tokens on (issue 15, done-when): the right token never meets a 5xx; no token never gets a 2xx ------

TOKEN = "fuzz-t0ken"
OPEN_OPERATIONS = {"GET /healthz"}
"""Open on purpose: liveness probes carry no token (and it shows no data when auth is on)."""


@pytest.fixture(scope="module")
def guarded_schema(tmp_path_factory):
    launcher, _ = make_launcher(nodes={})
    app = make_app(tmp_path_factory.mktemp("fuzz-auth"), launcher, token=TOKEN)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    stop_all(launcher)


@pytest.mark.parametrize("label", OPERATIONS)
def test_with_the_token_no_request_gets_a_server_error(guarded_schema, label):
    op = guarded_schema.find_operation_by_label(label)
    seen = []

    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()
    assert seen and max(seen) < 500 and min(seen) != 401


@pytest.mark.parametrize("label", OPERATIONS)
def test_without_the_token_no_request_succeeds(guarded_schema, label):
    op = guarded_schema.find_operation_by_label(label)
    seen = []

    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            seen.append(case.call(headers=headers).status_code)

    run()
    if label in OPEN_OPERATIONS:
        assert set(seen) == {200}
    else:
        assert seen and set(seen) <= {401, 403}, (label, sorted(set(seen)))


# -- with a user's token (issue 42): a user meets no 5xx either, and never another user's job --------------

USER, OTHER = "us3r-t0ken", "0ther-t0ken"


@pytest.fixture(scope="module")
def user_schema(tmp_path_factory):
    launcher, _ = make_launcher(nodes={})
    root = tmp_path_factory.mktemp("fuzz-user")
    app = make_app(root, launcher, token=TOKEN, user_tokens={"ann": USER, "ben": OTHER}, db=root / "runs" / "elastron.db",
                   data_roots=(root / "data",), object_stores=("s3://bucket",), max_live_jobs=None)
    app.state.jobs.submit(SPEC, owner="ben", run_dir="bens-run")  # what ann must never see
    yield schemathesis.openapi.from_asgi("/openapi.json", app), app
    stop_all(launcher)


@pytest.mark.parametrize("label,mode", CASES, ids=[f"{lb} {m.value}" for lb, m in CASES])
def test_with_a_user_token_no_request_gets_a_server_error(user_schema, label, mode):
    schema, app = user_schema
    op = schema.find_operation_by_label(label)
    others = {x for r in app.state.jobs.store.list() if r.owner == "ben" for x in (r.id, "bens-run")}
    assert others
    seen = []

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        response = case.call(headers={"Authorization": f"Bearer {USER}"})
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])
        assert not any(o in response.text for o in others)  # nothing of the other user's job

    run()
    assert seen and max(seen) < 500 and (mode is GenerationMode.NEGATIVE or min(seen) != 401)
