"""The dashboard in a real browser (Playwright driving Debian's chromium, see scripts/browser-deps.sh):
a tiny fake-group job runs behind a live uvicorn on 127.0.0.1; the chart gains points, and pressing
Resize changes the layout shown."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.api.helpers import SPEC, live_server, make_app, make_launcher, stop_all

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: run scripts/browser-deps.sh")
CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("Debian chromium is not installed: run scripts/browser-deps.sh", allow_module_level=True)

J = "/api/v1/jobs"
TIMEOUT_MS = 20_000


def points(page, chart: str) -> int:
    return int(page.get_attribute(f"#{chart}", "data-points"))


def test_live_charts_and_resize_from_the_dashboard(tmp_path):
    launcher, _ = make_launcher(step_s=0.02)  # ~50 fake steps a second, so the chart visibly grows
    with live_server(make_app(tmp_path, launcher)) as url, sync_api.sync_playwright() as pw:
        job_id = httpx.post(url + J, json={"spec": SPEC, "steps": 100_000}).json()["id"]
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url + "/")
            page.wait_for_selector(f"#jobs tbody tr[data-id='{job_id}']")
            page.wait_for_function("() => document.getElementById('state').textContent === 'RUNNING'")
            assert page.text_content("#layout") == "dp=4 tp=1 pp=1 · 4 workers"

            page.wait_for_function("() => +document.getElementById('loss-chart').dataset.points >= 3")
            first = points(page, "loss-chart")
            page.wait_for_function(f"() => +document.getElementById('loss-chart').dataset.points > {first}")
            assert points(page, "tps-chart") > 0
            # validation loss in the loss chart: the fake rows evaluate every second step
            page.wait_for_function("() => +document.getElementById('loss-chart').dataset.morePoints >= 1")
            # MFU next to tokens/s: the fake rows carry 0.001 * step
            page.wait_for_function("() => /^[0-9]+[.][0-9]%$/.test(document.getElementById('mfu').textContent)")

            page.fill("#resize-n", "2")
            page.click("#resize")
            page.wait_for_function("() => document.getElementById('layout').textContent.startsWith('dp=2 tp=1 pp=1')")
            assert page.text_content("#layout") == "dp=2 tp=1 pp=1 · 2 workers"
            assert page.text_content("#message") == "resize accepted"
            page.wait_for_selector("#timeline g.segment[data-layout='2×1×1']", state="attached")
            assert page.get_attribute("#timeline", "data-segments") == "2"
            assert page.locator("#timeline g.mark-resize").count() == 1

            page.click("#pause")
            page.wait_for_function("() => document.getElementById('state').textContent === 'PAUSED'")
            assert page.is_enabled("#resume") and not page.is_enabled("#pause")
            page.click("#resume")
            page.wait_for_function("() => document.getElementById('state').textContent === 'RUNNING'")

            # What the page holds is the server's history: no event twice, none skipped, steps in order.
            server_events = httpx.get(f"{url}{J}/{job_id}/events").json()
            page.wait_for_function(f"() => view.events.length >= {len(server_events)}")
            assert page.evaluate("view.events.map(e => e.time)")[:len(server_events)] == [
                e["time"] for e in server_events]
            assert page.evaluate("view.metrics.every((m, i, a) => i === 0 || m.step > a[i - 1].step)")

            page.wait_for_function("() => document.querySelectorAll('#nodes tbody tr').length === 2")
            assert page.locator("#nodes td.node-alive").count() == 2
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()
            httpx.post(f"{url}{J}/{job_id}/stop")
    stop_all(launcher)


def test_the_queue_priorities_and_held_workers_fit_at_1400_px(tmp_path):
    launcher, _ = make_launcher({"a": 2}, step_s=0.02)
    spec = {**SPEC, "name": "a-rather-long-job-name-that-must-wrap-inside-its-column",
            "parallel": {"min_workers": 2, "max_workers": 2}}
    with live_server(make_app(tmp_path, launcher, schedule=True)) as url, sync_api.sync_playwright() as pw:
        running = httpx.post(url + J, json={"spec": spec, "steps": 100_000}).json()["id"]
        queued = httpx.post(url + J, json={"spec": {**spec, "scheduling": {"priority": -1}}, "steps": 5}).json()["id"]
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url + "/")
            row = f"#jobs tbody tr[data-id='{queued}']"
            page.wait_for_function(f"() => document.querySelector(\"{row} td:nth-child(3)\")?.textContent === 'QUEUED #1'")
            assert page.text_content(f"{row} td:nth-child(4)") == "-1"  # its priority
            assert "needs 2 workers" in page.get_attribute(f"{row} td:nth-child(3)", "title")
            page.wait_for_function("() => !document.getElementById('queue').hidden")
            assert page.text_content("#queue li").startswith(f"{spec['name']} ({queued}, priority -1): needs 2 workers")
            run_row = f"#jobs tbody tr[data-id='{running}']"
            page.wait_for_function(f"() => document.querySelector(\"{run_row} td:nth-child(7)\")?.textContent === '2'")
            assert page.get_attribute(f"{run_row} td:nth-child(7)", "title") == "a: 2"
            # every column fits: the table is no wider than its panel, and no cell is cut off at its right
            fits = page.evaluate("""() => {
                const t = document.getElementById('jobs'), p = document.getElementById('jobs-panel');
                const last = t.querySelector('thead th:last-child').getBoundingClientRect();
                return t.scrollWidth <= p.clientWidth + 1 && last.right <= p.getBoundingClientRect().right + 1;
            }""")
            assert fits
            assert errors == []
        finally:
            browser.close()
            httpx.post(f"{url}{J}/{running}/stop")
    stop_all(launcher)
