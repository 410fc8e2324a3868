"""Issue 29 item 4: what JSON can carry but the service cannot use (invalid UTF-8 bytes, lone surrogates,
non-finite numbers, a field spelled where it does not belong) gets a 4xx naming the field with every
kind of token, never a 5xx; and failing submits leave the job manager's lock table as it was."""

from __future__ import annotations

import itertools
import json

import pytest
from fastapi.testclient import TestClient

from tests.api.helpers import SPEC, make_app, make_launcher, stop_all

J = "/api/v1/jobs"
TOKENS = {"admin": "adm1n", "user": "al1ce", "read": "r3ad", "none": None}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    launcher, _ = make_launcher(nodes={})  # jobs that pass validation wait for capacity: cheap
    app = make_app(tmp_path_factory.mktemp("submit-fuzz"), launcher, token="adm1n", read_token="r3ad",
                   user_tokens={"alice": "al1ce"})
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, app
    stop_all(launcher)


def _with(path: tuple[str, ...], value) -> dict:
    spec = json.loads(json.dumps(SPEC))
    d = spec
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value
    return {"spec": spec}


NUMBERS = [("train", "lr"), ("train", "weight_decay"), ("train", "grad_clip"), ("train", "steps"),
           ("data", "seq_len"), ("scheduling", "weight"), ("scheduling", "priority"), ("model", "overrides", "dim")]
TEXTS = [("name",), ("model", "preset"), ("data", "path"), ("checkpoint", "dir"), ("checkpoint", "resume_from")]


def bodies() -> list[tuple[str, bytes]]:
    out = []
    for path, v in itertools.product(NUMBERS, (float("inf"), float("-inf"), float("nan"), 1e309)):
        out.append((f"{'.'.join(path)}={v}", json.dumps(_with(path, v)).encode()))
    for path in TEXTS:
        out.append((f"{'.'.join(path)}=surrogate", json.dumps(_with(path, "x\ud800y")).encode()))
        raw = json.dumps(_with(path, "__BYTES__")).encode().replace(b"__BYTES__", b"\xff\xfe\xc3")
        out.append((f"{'.'.join(path)}=invalid-utf8", raw))
    out.append(("run_dir=surrogate", json.dumps({"spec": SPEC, "run_dir": "r\udc80"}).encode()))
    out.append(("overrides.preset", json.dumps(_with(("model", "overrides"), {"preset": "small"})).encode()))
    out.append(("spec=bytes", b'{"spec": "\xc0\xaf"}'))
    out.append(("truncated", b'{"spec": {"name": "x"'))
    return out


@pytest.mark.parametrize("who", list(TOKENS))
def test_unusable_values_get_a_4xx_with_every_token(served, who):
    c, _ = served
    headers = {"content-type": "application/json"}
    if TOKENS[who]:
        headers["Authorization"] = f"Bearer {TOKENS[who]}"
    bad = {}
    for label, raw in bodies():
        r = c.post(J, content=raw, headers=headers)
        if not 400 <= r.status_code < 500:
            bad[label] = (r.status_code, r.text[:200])
    assert bad == {}
    if who in ("admin", "user"):  # and a valid submit still works after them
        assert c.post(J, json={"spec": SPEC}, headers=headers).status_code == 201


def test_a_loop_of_failing_submits_leaves_the_lock_table_as_it_was(served):
    c, app = served
    mgr = app.state.jobs
    h = {"Authorization": "Bearer al1ce"}
    first = c.post(J, json={"spec": SPEC, "run_dir": "taken"}, headers=h)
    assert first.status_code == 201
    before = mgr.locks.known()
    for i in range(50):  # conflicts (in use), refusals inside the submit (resume_from), bad values
        assert c.post(J, json={"spec": SPEC, "run_dir": "taken/inner"}, headers=h).status_code == 409
        spec = {**SPEC, "checkpoint": {"resume_from": "s3://nobody/ck"}}
        assert c.post(J, json={"spec": spec}, headers=h).status_code == 422
        raw = json.dumps(_with(("name",), "x\ud800")).encode()  # JSON's \\ud800 escape
        assert c.post(J, content=raw, headers={**h, "content-type": "application/json"}).status_code == 422
    assert mgr.locks.known() == before
