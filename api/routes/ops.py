"""/healthz and /metrics (Prometheus exposition, read from the job store at scrape time)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from api.deps import JobsDep, OverseerDep, SettingsDep
from api.schemas import ErrorBody, Health
from service.server.job_manager import JobManager

router = APIRouter(tags=["ops"])

STATES = ("PENDING", "STARTING", "RUNNING", "RESIZING", "RECOVERING", "WAITING_FOR_CAPACITY", "QUEUED",
          "PAUSED", "SUCCEEDED", "FAILED", "STOPPED", "UNKNOWN")


class JobCollector:
    """One sample per job and metric, labelled by the job's id only (12 hex digits): a job's name is the
    user's free text, which a label would copy into every sample (GET /api/v1/jobs/ID gives it). Finished
    jobs stay until deleted or pruned (a user's oldest beyond ELASTRON_MAX_FINISHED_JOBS), so a job's last
    values remain visible."""

    def __init__(self, jobs: JobManager):
        self.jobs = jobs

    def collect(self):
        labels = ["job"]
        g = {k: GaugeMetricFamily(f"elastron_job_{k}", doc, labels=labels) for k, doc in (
            ("step", "Last completed optimizer step."),
            ("loss", "Training loss at the last step."),
            ("val_loss", "Loss on the held-out split at the last evaluation (train.eval_interval)."),
            ("tokens_per_second", "Training throughput at the last step."),
            ("mfu", "Model FLOPs utilisation (0..1) at the last step; no sample where unknown (e.g. on CPUs)."),
            ("world_size", "Workers in the current worker group (0 when none)."),
            ("committed_step", "Step of the last committed checkpoint."),
        )}
        degree = GaugeMetricFamily("elastron_job_parallel_degree", "Degree of each parallel axis (dp, tp, pp) of "
                                   "the current layout.", labels=labels + ["axis"])
        state = GaugeMetricFamily("elastron_job_state", "1 for the job's current state.", labels=labels + ["state"])
        reconf = CounterMetricFamily("elastron_job_reconfigurations", "Reconfigurations by cause (planned start, "
                                     "grow, preemption, failure, user).", labels=labels + ["cause"])
        lost = CounterMetricFamily("elastron_job_steps_lost", "Steps redone after unplanned failures.", labels=labels)
        by_state = {s: 0 for s in STATES}
        for r in self.jobs.list():
            lv, st = [r.id], r.status
            by_state[r.state] = by_state.get(r.state, 0) + 1
            for key, v in (("step", st.step), ("loss", st.loss), ("val_loss", st.val_loss),
                           ("tokens_per_second", st.tokens_per_s), ("mfu", st.mfu), ("world_size", st.world_size),
                           ("committed_step", st.committed_step)):
                if v is not None:
                    g[key].add_metric(lv, float(v))
            for axis, v in (st.degrees or {}).items():
                degree.add_metric(lv + [axis], float(v))
            state.add_metric(lv + [r.state], 1.0)
            for cause, n in st.reconfigurations.items():
                reconf.add_metric(lv + [cause], float(n))
            lost.add_metric(lv, float(st.steps_lost))
        jobs = GaugeMetricFamily("elastron_jobs", "Jobs known to the server, by state.", labels=["state"])
        for s, n in by_state.items():
            jobs.add_metric([s], float(n))
        yield from (*g.values(), degree, state, reconf, lost, jobs)


def make_registry(jobs: JobManager) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(JobCollector(jobs))
    return reg


@router.get("/healthz", response_model=Health)
def healthz(jobs: JobsDep, settings: SettingsDep) -> Health:
    """Liveness, open to probes without a token (the job count only when the server has no token)."""
    return Health(status="ok", jobs=None if settings.auth else jobs.count())


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text exposition."},
                       401: {"model": ErrorBody, "description": "No bearer token."},
                       403: {"model": ErrorBody, "description": "Not the admin or read-only token."}})
def prometheus(request: Request, who: OverseerDep) -> Response:
    """Every job's gauges: needs the admin or the read-only token (ELASTRON_READ_TOKEN) when auth is on."""
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
