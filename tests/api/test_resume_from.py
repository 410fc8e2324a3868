"""Issue 29 items 2, 3 and 9: checkpoint.resume_from follows the same rules as checkpoint.dir, and a user
may name only their own jobs' checkpoints (or those under the server's resume prefixes); URL scheme
aliases and '..' cannot slip past the check that each job's directories are its own; a conflict with
another user's job does not name it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.helpers import SPEC, make_app, make_launcher, stop_all

J = "/api/v1/jobs"
ADMIN, ALICE, BOB = "adm1n", "al1ce", "b0b"


def bearer(tok: str) -> dict:
    return {"Authorization": f"Bearer {tok}"}


def spec(**checkpoint) -> dict:
    return {**SPEC, "checkpoint": {**SPEC.get("checkpoint", {}), **checkpoint}}


@pytest.fixture
def c(tmp_path):
    launcher, _ = make_launcher(nodes={})  # jobs wait for capacity: cheap
    app = make_app(tmp_path, launcher, token=ADMIN, user_tokens={"alice": ALICE, "bob": BOB},
                   resume_prefixes=("s3://shared/base",),
                   object_stores=("s3://bucket", "gs://b2", "abfs://c@acct.dfs.core.windows.net"), azure_account="acct")
    with TestClient(app) as client:
        yield client
    stop_all(launcher)


def submit(c, tok, body_spec, **kw):
    return c.post(J, json={"spec": body_spec, **kw}, headers=bearer(tok))


def test_a_user_resumes_from_their_own_jobs_checkpoints_and_never_from_another_users(c):
    a = submit(c, ALICE, SPEC).json()["id"]
    alice_dir = c.get(f"{J}/{a}", headers=bearer(ALICE)).json()["run_dir"]
    r = submit(c, BOB, spec(resume_from=f"{alice_dir}/checkpoints"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "checkpoint", "resume_from"]
    assert "not a directory of one of your jobs" in r.json()["detail"][0]["msg"] and "alice" not in r.text
    assert submit(c, ALICE, spec(resume_from=f"{alice_dir}/checkpoints")).status_code == 201
    assert submit(c, ADMIN, spec(resume_from=f"{alice_dir}/checkpoints")).status_code == 201  # the admin may
    assert submit(c, BOB, spec(resume_from="s3://shared/base/llama")).status_code == 201  # an allowed prefix


@pytest.mark.parametrize("src", ["/etc", "../../..", "http://169.254.169.254/latest/meta-data", "sftp://host/ck",
                                 "memory://x", "https://example.com/ck", "s3://shared/base/../other",
                                 "file:///etc/passwd", "relative/dir", "s3://someone-elses-bucket/ck"])
def test_resume_from_outside_the_rules_is_refused_before_anything_runs(c, src):
    r = submit(c, BOB, spec(resume_from=src))
    assert r.status_code == 422, (src, r.text)
    assert r.json()["detail"][0]["loc"] == ["body", "spec", "checkpoint", "resume_from"], r.text


@pytest.mark.parametrize("first, second", [("s3://bucket/ck", "s3a://bucket/ck"), ("gs://b2/ck", "gcs://b2/ck"),
                                           ("abfs://c/ck", "az://c/ck/inner")])
def test_scheme_aliases_are_the_same_store(c, first, second):
    assert submit(c, ALICE, spec(dir=first)).status_code == 201
    r = submit(c, ALICE, spec(dir=second))
    assert r.status_code == 409, r.text


def test_dot_dot_in_a_checkpoint_url_is_refused(c):
    r = submit(c, ALICE, spec(dir="s3://bucket/x/../ck"))
    assert r.status_code == 422 and "must not contain '..'" in r.text


def test_a_conflict_with_another_users_job_names_neither_the_job_nor_its_path(c):
    a = submit(c, ALICE, spec(dir="s3://bucket/alice-ck")).json()["id"]
    r = submit(c, BOB, spec(dir="s3://bucket/alice-ck/inner"))
    assert r.status_code == 409 and a not in r.text and "another user's job" in r.text
    r = submit(c, ALICE, spec(dir="s3://bucket/alice-ck/inner"))  # her own: the job is named, to delete it
    assert r.status_code == 409 and a in r.text
