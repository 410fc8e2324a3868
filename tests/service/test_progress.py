"""service.control.progress: rows recovered from workers reach RUN_DIR/metrics.jsonl when rank 0 never
logged them."""

from __future__ import annotations

import json

from parallel.layout import Layout
from service.control.progress import Progress
from workers.report import StepMetrics, Taken


def _row(step: int, **kw) -> StepMetrics:
    return StepMetrics(step=step, loss=5.0 - step / 100, lr=1e-3, grad_norm=1.0, tokens=12 * step, layout=Layout(),
                       world_size=2, time=1000.0 + step, step_time=0.1, tokens_per_s=10.0, **kw)


def _logged(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_step_the_survivors_finished_but_rank_0_never_logged_gets_its_row(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(_row(s).to_json() + "\n" for s in (199, 200)))
    p = Progress(run_dir=tmp_path)
    # the survivors finished 201 (rank 0 died before writing it); their rows repeat 200
    p.recovered([_row(200), _row(201, snapshot=Taken(wait_s=0, agree_s=0, copy_s=0, committed=200))], at=201)
    assert _logged(tmp_path) == [199, 200, 201] and p.step_done == 201
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["loss"] == 5.0 - 2.01 and "snapshot" not in last  # the row as rank 0 writes it


def test_rows_past_the_step_the_job_resumes_at_are_not_logged(tmp_path):
    # the next group forms from peer snapshots of step 200: 201 will be trained (and logged) again
    (tmp_path / "metrics.jsonl").write_text(_row(200).to_json() + "\n")
    p = Progress(run_dir=tmp_path)
    p.recovered([_row(201)], at=200)
    assert _logged(tmp_path) == [200]
    Progress().recovered([_row(202)], at=202)  # without a run directory: nothing to write
