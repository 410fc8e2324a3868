"""Issue 42: every place a request names goes through one canonical form and one rule
(service.server.admission); who holds a place is recorded in the store, also after DELETE; typed model
overrides; bounded waits. Pure tests first, then the job manager over a fake launcher."""

from __future__ import annotations

import math
import threading
import time

import pytest

from api.schemas import JobSubmit
from api.store import JobStore
from models.config import ModelConfig
from parallel.layout import Layout
from parallel.memory import estimate_memory
from service.control.status import JobStatus
from service.server.admission import LOCATION_FIELDS, Admission, Claim, Place, canonical
from service.server.job_manager import JobConflict, JobManager, JobNotFound, JobUnavailable
from service.server.specs import SpecError, validate_spec
from tests.api.helpers import HandleLauncher

SPEC = {"name": "h", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2}}

# -- the fields that name a place: walked from the request schema ---------------------------------------------

NOT_PLACES = {
    ("spec", "name"): "a label; the default run directory uses safe_name(name) inside the runs root",
    ("spec", "model", "preset"): "a key of models.config.PRESETS",
    ("spec", "model", "resolved", "family"): "read from init_from's config.json, never from a request",
    ("spec", "model", "resolved", "rope_scaling"): "read from init_from's config.json, never from a request",
    ("spec", "model", "overrides", "family"): "a literal (workers.config.ModelOverrides)",
    ("spec", "model", "overrides", "rope_scaling"): "RoPE scaling numbers and a rope_type name",
    ("spec", "data", "source"): "a literal",
    ("spec", "data", "suffixes"): "file name endings matched inside data.path",
    ("spec", "data", "token_dtype"): "a literal",
    ("spec", "train", "schedule"): "a literal", ("spec", "train", "dtype"): "a literal",
    ("spec", "train", "activation_checkpointing"): "a literal", ("spec", "train", "float8"): "a literal",
    ("spec", "parallel", "layout"): "a layout string (Layout.parse)", ("spec", "parallel", "dp_mode"): "a literal",
    ("spec", "parallel", "pp_schedule"): "a literal", ("spec", "parallel", "reshard"): "a literal",
    ("spec", "checkpoint", "checksum"): "a literal", ("spec", "resources", "device"): "a literal",
    ("spec", "logging", "wandb", "project"): "a W&B project name", ("spec", "logging", "wandb", "mode"): "a literal",
}
"""Every string (or free-form object) field of a submit request that is not a place, with why."""


def _text_fields() -> set[tuple[str, ...]]:
    """Every field of the submit request that can hold a string: typed str, a list of str, or a free-form
    object (whose values could be anything)."""
    schema = JobSubmit.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(s):
        while "$ref" in s:
            s = defs[s["$ref"].split("/")[-1]]
        return s

    def alternatives(s):
        s = resolve(s)
        return [s] + [y for x in s.get("anyOf", []) + s.get("allOf", []) for y in alternatives(x)]

    def can_hold_text(s):
        for a in alternatives(s):
            if a.get("type") == "string" or (a.get("type") == "object" and not a.get("properties")):
                return True
            if a.get("type") == "array" and can_hold_text(a.get("items", {})):
                return True
        return False

    out: set[tuple[str, ...]] = set()

    def walk(s, path):
        for a in alternatives(s):
            for name, p in a.get("properties", {}).items():
                if can_hold_text(p):
                    out.add((*path, name))
                walk(p, (*path, name))

    walk(schema, ())
    return out


def test_every_request_field_that_can_name_a_place_is_judged_by_admission():
    fields = _text_fields()
    assert ("spec", "data", "val_path") in fields and ("run_dir",) in fields  # the walk sees them
    unclassified = fields - set(LOCATION_FIELDS) - set(NOT_PLACES)
    assert not unclassified, (f"request fields {sorted(unclassified)} can hold a path: add each to "
                              "service.server.admission.LOCATION_FIELDS (or, if it names no place, to NOT_PLACES)")
    assert not set(NOT_PLACES) - fields, "NOT_PLACES names a field the request no longer has"


def _set(spec: dict, loc: tuple[str, ...], value) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in spec.items()}
    d = out
    for k in loc[:-1]:
        d = d.setdefault(k, {})
    d[loc[-1]] = value
    return out


@pytest.mark.parametrize("loc", [l for l in LOCATION_FIELDS if l != ("run_dir",)], ids=".".join)
def test_each_place_field_is_checked_before_the_disk(tmp_path, loc):
    adm = Admission(runs_root=tmp_path / "runs", data_roots=[tmp_path / "data"])
    spec = _set({"data": {"source": "corpus"}}, loc[1:], "/etc")
    with pytest.raises(SpecError) as e:
        adm.check(spec, run_dir=None, default_name="j", owner="bob", claims=())
    assert e.value.loc == loc


def test_a_run_dir_is_checked(tmp_path):
    adm = Admission(runs_root=tmp_path / "runs")
    with pytest.raises(SpecError) as e:
        adm.check({}, run_dir="/etc", default_name="j", owner="bob", claims=())
    assert e.value.loc == ("run_dir",)


# -- the canonical form --------------------------------------------------------------------------------------

SAME = [
    ("abfs://ckpts@acct.dfs.core.windows.net/bob", "abfs://ckpts/bob"),
    ("az://ckpts@acct.blob.core.windows.net/bob/x", "abfs://ckpts/bob/x"),
    ("abfss://CKPTS@ACCT.dfs.core.windows.net/bob", "abfs://ckpts/bob"),
    ("hdfs://nn/a", "hdfs://nn:8020/a"),
    ("hdfs://NN:8020/a", "hdfs://nn:8020/a"),
    ("s3a://Bucket/x", "s3://bucket/x"),
    ("s3n://bucket//x/./y/", "s3://bucket/x/y"),
    ("gcs://b/x", "gs://b/x"),
]


@pytest.mark.parametrize("a,b", SAME)
def test_two_spellings_of_one_store_are_one_place(a, b):
    assert canonical(a, azure_account="acct") == canonical(b, azure_account="acct")


REFUSED = [
    ("hdfs:///a", "names no namenode"),
    ("FILE:///etc", "lower case"),
    ("S3://bucket/x", "lower case"),
    ("s3://arn:aws:s3:us-east-1:123:accesspoint/ap/x", "not an access point"),
    ("s3://user@bucket/x", "user information"),
    ("s3://bucket/x?versionId=1", "must not hold '?'"),
    ("abfs://ckpts/bob", "name the storage account"),  # no default account here
    ("abfs://c@evil.example.com/x", "CONTAINER@ACCOUNT.dfs.core.windows.net"),
    ("simplecache::s3://bucket/x", "chained URLs"),
    ("s3://bucket/a/../b", "'..'"),
    ("memory://x", "memory://"),
    ("http://169.254.169.254/x", "scheme must be one of"),
    ("relative/x", "absolute path"),
]


@pytest.mark.parametrize("where,why", REFUSED)
def test_forms_that_cannot_be_compared_safely_are_refused(where, why):
    with pytest.raises(SpecError) as e:
        canonical(where, ("spec", "checkpoint", "dir"))
    assert why in e.value.msg and e.value.loc == ("spec", "checkpoint", "dir")


def test_a_symlink_is_the_place_it_leads_to(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert canonical(str(tmp_path / "link" / "x")) == canonical(f"file://{tmp_path}/real/x")


# -- the rule ------------------------------------------------------------------------------------------------

def test_object_stores_and_hdfs_hosts_only_from_the_operators_list(tmp_path):
    adm = Admission(runs_root=tmp_path, object_stores=("s3://ckpts", "hdfs://nn:8020/jobs"))
    assert adm.write("s3a://ckpts/bob", ("spec", "checkpoint", "dir")) == Place(("s3://", "ckpts", "bob"))
    assert adm.write("hdfs://NN/jobs/x", ("spec", "checkpoint", "dir")).parts == ("hdfs://", "nn:8020", "jobs", "x")
    for bad in ("s3://other/bob", "hdfs://attacker.example:8020/jobs/x", "hdfs://nn:8021/jobs/x", "hdfs://nn/other",
                "abfs://c@attacker.dfs.core.windows.net/x"):
        with pytest.raises(SpecError, match="not inside an object store this server allows"):
            adm.write(bad, ("spec", "checkpoint", "dir"))


def test_the_stores_files_are_reserved(tmp_path):
    db = tmp_path / "runs" / "elastron.db"
    adm = Admission(runs_root=tmp_path / "runs", reserved=JobStore(db).files())
    for name in ("elastron.db", "elastron.db-journal", "elastron.db-wal", "elastron.db-shm", "elastron.db-wal/x"):
        with pytest.raises(SpecError, match="reserved for the server's own files"):
            adm.run_dir(name, "j")
    assert adm.run_dir("elastron.db-other", "j").path == db.parent / "elastron.db-other"


def test_a_shared_resume_prefix_is_read_only_and_usable_outside_the_runs_root(tmp_path):
    base = tmp_path / "base"
    adm = Admission(runs_root=tmp_path / "runs", resume_prefixes=(str(base), "s3://shared/base"),
                    object_stores=("s3://shared",))
    loc = ("spec", "checkpoint", "dir")
    for w in (str(base / "llama"), "s3://shared/base/x", "s3://shared"):
        with pytest.raises(SpecError, match="read-only"):
            adm.write(w, loc)
    assert adm.resume(str(base / "llama"), ("spec", "checkpoint", "resume_from"), owner="bob", claims=()).local


def test_a_user_resumes_only_from_places_they_hold_tombstones_included(tmp_path):
    adm = Admission(runs_root=tmp_path)
    mine = Claim(job_id="a", owner="alice", field="run_dir", place=canonical(str(tmp_path / "a")), deleted=True)
    loc = ("spec", "checkpoint", "resume_from")
    assert adm.resume(str(tmp_path / "a" / "checkpoints"), loc, owner="alice", claims=[mine])
    with pytest.raises(SpecError, match="not a directory of one of your jobs"):
        adm.resume(str(tmp_path / "a" / "checkpoints"), loc, owner="bob", claims=[mine])
    assert adm.resume(str(tmp_path / "a"), loc, owner=None, claims=())  # the admin


# -- typed model overrides -----------------------------------------------------------------------------------

def test_every_model_field_has_a_type_and_limits():
    from workers.config import ModelOverrides

    fields = set(ModelConfig.__dataclass_fields__)
    assert set(ModelOverrides.__annotations__) == fields, sorted(fields ^ set(ModelOverrides.__annotations__))


@pytest.mark.parametrize("name,value", [("rope_theta", "x"), ("norm_eps", [1]), ("tie_embeddings", "yes"),
                                        ("init_std", math.nan), ("head_size", 2**62), ("head_size", 10**400),
                                        ("dim", True), ("family", "gpt"), ("rope_scaling", {"factor": math.inf}),
                                        ("sliding_window", 0), ("norm_eps", 0.0), ("nope", 1)])
def test_a_wrong_override_is_refused_at_submit_naming_the_field(name, value):
    with pytest.raises(SpecError) as e:
        validate_spec({**SPEC, "model": {"overrides": {name: value}}})
    assert e.value.loc[:4] == ("spec", "model", "overrides", name) and "\n" not in e.value.msg  # or inside it
    assert len(e.value.msg) < 300


def test_good_overrides_pass():
    for name, value in (("rope_theta", 500000.0), ("head_size", None), ("head_size", 32),
                        ("rope_scaling", {"rope_type": "linear", "factor": 2.0})):
        assert validate_spec({**SPEC, "model": {"overrides": {name: value}}}).model.overrides == {name: value}


def test_a_model_too_large_for_a_float_is_a_value_error_not_an_overflow():
    m = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_hidden=128, head_size=10**400)
    with pytest.raises(ValueError, match="too many to estimate"):
        estimate_memory(m, Layout(dp_replicate=1, dp_shard=1, tp=1, pp=1), micro_batch_size=1, seq_len=8)


# -- the job manager: ownership recorded, bounded waits ------------------------------------------------------

class Handle:
    """A coordinator; a stuck one answers nothing, and each call gives up after 0.3 s as a Ray call's
    timeout does (JobUnavailable)."""

    def __init__(self, stuck: threading.Event | None = None):
        self.stuck, self.calls = stuck, 0

    def status(self):
        self.calls += 1
        if self.stuck is not None and not self.stuck.wait(0.3):
            raise JobUnavailable("no answer within 0.3 s")
        return JobStatus(state="RUNNING", reason="", step=1, total_steps=10, world_size=1)

    def events_since(self, index=0):
        return []

    def metrics_since(self, step=0):
        return []

    def send(self, cmd):
        if self.stuck is not None:
            self.stuck.wait(30)  # a command waits longer: it holds the job's lock meanwhile


def stuck_launcher(stuck: threading.Event) -> HandleLauncher:
    """Coordinators that are stuck (answer nothing until `stuck` is set) for jobs named "stuck..."."""
    return HandleLauncher(lambda job: Handle(stuck if job.cfg.name.startswith("stuck") else None))


@pytest.fixture
def stuck():
    ev = threading.Event()
    yield ev
    ev.set()


def manager(tmp_path, stuck, **kw) -> JobManager:
    return JobManager(JobStore(tmp_path / "runs" / "elastron.db"), stuck_launcher(stuck), runs_root=tmp_path / "runs",
                      sync_interval_s=0.02, stop_timeout_s=0.2, **kw)


def test_a_deleted_jobs_places_stay_its_owners_until_an_admin_frees_them(tmp_path, stuck):
    m = manager(tmp_path, stuck, object_stores=("s3://b",))
    a = m.submit({**SPEC, "checkpoint": {"dir": "s3://b/alice"}}, owner="alice")
    rd = m.get(a).run_dir
    m.delete(a, owner="alice", force=True)
    for spec, run_dir in (({**SPEC, "checkpoint": {"dir": "s3a://b/alice/x"}}, None), (SPEC, rd)):
        with pytest.raises(JobConflict, match="another user's job"):
            m.submit(spec, owner="bob", run_dir=run_dir)
    with pytest.raises(SpecError, match="not a directory of one of your jobs"):
        m.submit({**SPEC, "checkpoint": {"resume_from": "s3://b/alice"}}, owner="bob")
    assert m.submit({**SPEC, "checkpoint": {"resume_from": "s3://b/alice"}}, owner="alice")  # still hers
    assert m.submit({**SPEC, "checkpoint": {"dir": "s3://b/alice"}}, owner="alice")  # and hers to reuse
    with pytest.raises(JobConflict, match="not deleted"):
        m.free_places(m.list()[-1].id)
    assert m.free_places(a)["freed"] == 2
    with pytest.raises(JobNotFound):
        m.free_places(a)
    assert m.submit(SPEC, owner="bob", run_dir=rd)


def test_places_of_jobs_from_before_the_store_kept_them_are_recorded_on_start(tmp_path, stuck):
    m = manager(tmp_path, stuck)
    a = m.submit(SPEC, owner="alice")
    with m.store._tx() as c:
        c.exec_driver_sql("DELETE FROM areas")
    m2 = manager(tmp_path, stuck)
    assert {c.job_id for c in m2.store.claims()} == {a}
    with pytest.raises(JobConflict):
        m2.submit(SPEC, owner="bob", run_dir=m.get(a).run_dir)


def test_a_user_has_at_most_max_live_jobs_unfinished(tmp_path, stuck):
    m = manager(tmp_path, stuck, max_live_jobs=2)
    m.submit(SPEC, owner="alice")
    m.submit(SPEC, owner="alice")
    with pytest.raises(JobConflict, match="ELASTRON_MAX_LIVE_JOBS=2"):
        m.submit(SPEC, owner="alice")
    assert m.submit(SPEC, owner="bob")  # per user
    assert m.submit(SPEC)  # the admin has no cap


def test_delete_waits_for_no_other_command_and_for_the_lock_only_so_long(tmp_path, stuck):
    m = manager(tmp_path, stuck, lock_timeout_s=0.3)
    j = m.submit({**SPEC, "name": "stuck"}, owner="alice")
    first = threading.Thread(target=lambda: pytest.raises(Exception, m.delete, j, owner="alice"), daemon=True)
    first.start()  # waits on the stuck coordinator, holding the job's lock
    time.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(JobUnavailable, match="another command"):
        m.delete(j, owner="alice")
    assert time.monotonic() - t0 < 0.25  # refused at once, not after the 0.3 s lock wait
    t0 = time.monotonic()
    with pytest.raises(JobUnavailable, match="busy"):  # a command finds the lock held: waits the timeout only
        with m.locks.held(j, m.store.get):
            pass
    assert 0.25 < time.monotonic() - t0 < 2


def test_one_owners_stuck_jobs_leave_sync_threads_for_everyone_else(tmp_path, stuck):
    m = manager(tmp_path, stuck, max_live_jobs=None)
    for i in range(10):
        m.submit({**SPEC, "name": f"stuck{i}"}, owner="alice")
    b = m.submit(SPEC, owner="bob")
    m.start()  # its first round waits for every job's first sync
    try:
        h = m.coordinators.get(b)
        time.sleep(0.4)  # alice's jobs are known slow by now
        before = h.calls
        time.sleep(1.0)
        # synced about every 20 ms when it has a thread; alice's ten stuck jobs, resubmitted each time
        # their calls give up, would leave it one sync a second or so
        assert h.calls - before >= 10, f"bob's job was synced {h.calls - before} times in 1 s"
    finally:
        stuck.set()
        m.close()


def test_a_users_view_names_no_other_users_job(tmp_path, stuck):
    m = manager(tmp_path, stuck)
    a, b = m.submit(SPEC, owner="alice"), m.submit(SPEC, owner="bob")
    a2 = m.submit(SPEC, owner="alice")
    why = f"shrunk 4→2 to admit job {b} (priority 5); job {a2} (priority 1) waits"
    m.store.add_events(a, 0, [{"time": 1.0, "kind": "transition", "job_id": a, "reason": why,
                               "details": {"by": f"job {b}"}}])
    m.store.set_status(a, JobStatus(state="RUNNING", reason=why, step=1, total_steps=10, world_size=2))
    ev = m.events(a, owner="alice")[0]
    assert ev["reason"] == f"shrunk 4→2 to admit another job; job {a2} (priority 1) waits"
    assert ev["details"] == {"by": "another job"}
    assert b not in m.get(a, owner="alice").status.reason and b not in m.list(owner="alice")[0].status.reason
    assert b in m.events(a)[0]["reason"] and b in m.get(a).status.reason  # the admin sees it


def test_a_user_gets_counts_of_the_cluster_and_the_admin_its_nodes(tmp_path, stuck):
    from types import SimpleNamespace as NS

    node = NS(node_id="node-secret-1", alive=True, cpus=8.0, gpus=1.0, draining=False, drain_deadline=None,
              is_head=True, death_reason=None)
    snap = NS(time=1.0, nodes=[node, NS(**{**vars(node), "node_id": "n2", "draining": True, "is_head": False})],
              usable_workers=lambda: 3)
    m = manager(tmp_path, stuck)
    m.launcher.cluster = lambda: snap
    mine = m.cluster(owner="bob")
    assert mine["nodes"] == [] and mine["node_count"] == 2 and mine["draining_nodes"] == 1 and mine["cpus"] == 16
    assert "node-secret-1" not in str(mine) and m.cluster()["nodes"][0]["node_id"] == "node-secret-1"


def test_the_operators_lists_come_from_the_environment(monkeypatch, tmp_path):
    from api.deps import Settings

    monkeypatch.setenv("ELASTRON_OBJECT_STORES", "s3://ckpts, hdfs://nn:8020/jobs")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("ELASTRON_MAX_LIVE_JOBS", "")
    s = Settings.from_env()
    assert s.object_stores == ("s3://ckpts", "hdfs://nn:8020/jobs") and s.azure_account == "acct"
    assert s.max_live_jobs is None
    monkeypatch.setenv("ELASTRON_MAX_LIVE_JOBS", "many")
    with pytest.raises(ValueError, match="ELASTRON_MAX_LIVE_JOBS must be a whole number"):
        Settings.from_env()
    with pytest.raises(ValueError, match="ELASTRON_OBJECT_STORES: .* is a local path"):
        Admission(runs_root=tmp_path, object_stores=("/srv/ckpts",))
    with pytest.raises(ValueError, match="ELASTRON_RESUME_PREFIXES: .*name the storage account"):
        Admission(runs_root=tmp_path, resume_prefixes=("abfs://c/base",))
