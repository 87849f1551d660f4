"""The portal in a real browser: headless Chromium (Debian's package, driven by Playwright)
against Daphne serving HTTP and websockets on the test database, with Redis as the channel
layer, so that what this process does (a scheduling cycle, a simulated cluster's tick) reaches
the pages live.

Screenshots of what the browser saw are kept in the test's temporary directory (the ones in
docs/ come from the demo: scripts/screenshots.py).

`wait_for_function` predicates are written as functions (`"() => …"`): Playwright polls a bare
expression through `eval` inside the page, which the Content-Security-Policy refuses."""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model

from clusters.choices import ClusterKind, NodeState
from clusters.models import Node
from scheduling.choices import JobState
from scheduling.dispatch.outbox import drain_outbox
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Job, JobEvent
from tests.factories import (
    ensure_catalog,
    make_cluster,
    make_job,
    make_node,
    make_project,
    make_queue,
    make_user,
)
from tests.processes import Service, control_plane_env, free_port

pytestmark = pytest.mark.django_db(transaction=True)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def server(tmp_path):
    if not settings.REDIS_URL:
        pytest.skip("the pages hear this process's events through the Redis channel layer")
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is missing: scripts/test-services.sh installs Debian's chromium package")
    port = free_port()
    env = control_plane_env(tmp_path, ORRERY_ALLOWED_HOSTS="127.0.0.1,localhost")
    argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"]
    daphne = Service(argv, env, tmp_path / "daphne.log", port).start()
    yield f"http://127.0.0.1:{port}"
    daphne.stop()


@pytest.fixture
def browser(monkeypatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the ORM calls of the test are
    # still plain synchronous code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()
        # The test's queries ran beside Playwright's loop, on a connection of their own.
        from django.db import connections

        connections.close_all()


def off_the_loop(work):
    """Run ``work`` on a thread of its own and return what it returns. Playwright's sync API keeps
    an event loop running on the test's thread, where the live events the work publishes (through
    ``async_to_sync``) could not be sent; on a plain thread they reach the pages as they would
    from a worker."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def run():
        try:
            return work()
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result(timeout=120)


@pytest.fixture
def fleet(settings):
    # The server checks passwords with the production hashers, not the tests' fast one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    ensure_catalog()
    alice, bob = make_user("alice"), make_user("bob")
    make_user("ops", staff=True)
    queue = make_queue(make_project("vision", members=(alice,)))
    make_queue(make_project("nlp", members=(bob,)))
    cluster = make_cluster("sim-a", kind=ClusterKind.SIMULATED)
    nodes = [make_node(cluster, gpus=8, model="h100", name=f"a{i:03d}") for i in range(40)]
    for i in range(3):
        make_job(alice, queue, name=f"finished-{i}", state=JobState.SUCCEEDED)
    return {"alice": alice, "queue": queue, "nodes": nodes}


def sign_in(page, server: str, user: str) -> None:
    page.goto(f"{server}/accounts/login/")
    page.fill('input[name="username"]', user)
    page.fill('input[name="password"]', user)
    page.click('button[type="submit"]')
    try:
        page.wait_for_url(f"{server}/", timeout=15_000)
    except Exception:
        raise AssertionError(page.content()[:3000]) from None


def test_a_researcher_submits_watches_and_cancels(server, browser, fleet, tmp_path):
    shots = tmp_path
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    sign_in(page, server, "alice")
    page.screenshot(path=str(shots / "dashboard.png"), full_page=True)

    page.goto(f"{server}/submit/")
    page.fill('input[name="name"]', "bad name!")  # the API's validator answers, field by field
    page.fill('textarea[name="run"]', "python train.py")
    page.click('#submit-form button[type="submit"]')
    try:
        page.wait_for_selector("#errors li", timeout=10_000)
    except Exception:
        raise AssertionError(problems) from None
    assert "metadata.name" in page.inner_text("#errors")
    page.fill('input[name="name"]', "train-resnet")
    page.fill('input[name="gpus"]', "2")
    page.select_option('select[name="model"]', "h100-80g")
    page.screenshot(path=str(shots / "submit.png"), full_page=True)
    page.click('#submit-form button[type="submit"]')
    page.wait_for_url(f"{server}/jobs/*/")
    job = Job.objects.get(name="train-resnet")
    assert page.inner_text("#job-state") == "PENDING"
    assert "Waiting for the scheduler" in page.inner_text("#job-why")  # why it is pending

    # The scheduler places it, the simulated cluster starts it: the page follows, no reload,
    # and so does the jobs list beside it (cluster, reason, a time used that ticks).
    listing = browser.new_page(viewport={"width": 1360, "height": 900})
    sign_in(listing, server, "alice")
    listing.goto(f"{server}/jobs/")
    listing.wait_for_function("() => document.querySelector('#live').className === 'live on'")
    row = f'tr[data-job="{job.pk}"]'
    assert listing.inner_text(f'{row} [data-cell="reason"]') == "—"  # not yet looked at: no "None"
    page.evaluate("window.loadedOnce = true")
    page.evaluate("document.querySelector('#timeline li').dataset.server = '1'")
    assert off_the_loop(lambda: run_cycle(SchedulerCache()).placed) == 1
    page.wait_for_function(
        "() => document.querySelector('#job-state').textContent === 'SCHEDULED'", timeout=30_000
    )
    off_the_loop(drain_outbox)
    page.wait_for_function(
        "() => document.querySelector('#job-state').textContent === 'RUNNING'", timeout=30_000
    )
    assert page.evaluate("window.loadedOnce") is True  # the same document all along
    page.wait_for_selector("#placement dt")
    assert "sim-a" in page.inner_text("#placement")
    page.screenshot(path=str(shots / "job.png"), full_page=True)
    # The timeline was redrawn live, its times as the server writes them.
    assert page.evaluate("document.querySelector('#timeline li[data-server]')") is None
    times = page.eval_on_selector_all("#timeline time", "ts => ts.map((t) => t.textContent)")
    submitted = JobEvent.objects.filter(job=job).order_by("id").first().at
    assert times[0] == f"{submitted:%Y-%m-%d %H:%M:%S}" and len(times) >= 3
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", t) for t in times), times

    listing.wait_for_function(
        f"() => document.querySelector('{row} [data-cell=\"cluster\"]').textContent === 'sim-a'",
        timeout=10_000,
    )
    ticking = f'{row} [data-cell="time"]'
    assert listing.get_attribute(ticking, "data-started")
    used = listing.inner_text(ticking)
    listing.wait_for_function(f"() => document.querySelector('{ticking}').textContent !== '{used}'")
    assert re.fullmatch(r"\d+:\d\d", listing.inner_text(ticking))
    listing.close()

    page.click('#job-actions button[data-action="cancel"]')
    page.wait_for_function(
        "() => document.querySelector('#job-state').textContent === 'CANCELLED'", timeout=30_000
    )
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED

    page.goto(f"{server}/jobs/")
    assert "train-resnet" in page.inner_text("table")
    page.screenshot(path=str(shots / "jobs.png"), full_page=True)
    page.evaluate("window.sameDocument = true")  # filtering swaps the table in place
    page.fill('input[name="q"]', "finished-1")
    page.click('form.filters button[type="submit"]')
    page.wait_for_url("**q=finished-1**")
    page.wait_for_function("() => document.querySelectorAll('tr[data-job]').length === 1")
    assert page.evaluate("window.sameDocument") is True and "finished-1" in page.inner_text("table")
    for name in ("clusters", "queues"):
        page.goto(f"{server}/{name}/")
        page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

    other = browser.new_page()
    sign_in(other, server, "bob")
    assert other.goto(f"{server}/jobs/{job.pk}/").status == 404  # not bob's project


def test_an_operator_drains_a_node_and_the_heatmap_follows(server, browser, fleet, tmp_path):
    shots = tmp_path
    watcher = browser.new_page(viewport={"width": 1360, "height": 900})
    sign_in(watcher, server, "alice")
    watcher.goto(f"{server}/fleet/")
    watcher.wait_for_function("() => document.querySelector('#heatmap').dataset.nodes === '40'")
    watcher.wait_for_function("() => document.querySelector('#live').className === 'live on'")
    ready = watcher.evaluate("Orrery.cellColour('a007')")
    assert ready == "rgb(46, 158, 91)"  # ready
    watcher.screenshot(path=str(shots / "fleet.png"), full_page=True)

    ops = browser.new_page(viewport={"width": 1360, "height": 900})
    sign_in(ops, server, "ops")
    ops.goto(f"{server}/admin/clusters/node/?q=a007")
    ops.check('input[name="_selected_action"]')
    ops.select_option('select[name="action"]', "drain")
    ops.click('button[name="index"]')
    ops.wait_for_selector(".messagelist")
    assert Node.objects.get(name="a007").state in (NodeState.DRAINED, NodeState.DRAINING)
    ops.screenshot(path=str(shots / "console.png"), full_page=True)
    # A node's page fits the window: its GPUs' long identifiers wrap, nothing scrolls sideways.
    node = Node.objects.get(name="a007")
    for gpu in node.gpus.all():
        gpu.uuid = f"GPU-3f5e8c1a-2b4d-4e6f-8a9b-0c1d2e3f4a{gpu.index:02d}"
        gpu.save(update_fields=["uuid"])
    ops.goto(f"{server}/admin/clusters/node/{node.pk}/change/")
    assert ops.evaluate("document.documentElement.scrollWidth <= window.innerWidth")

    watcher.wait_for_function("() => Orrery.cellColour('a007') !== 'rgb(46, 158, 91)'", timeout=10_000)
    assert watcher.evaluate("Orrery.cellColour('a006')") == ready  # only that cell changed


# Recorded from the first script of every document (Playwright's init scripts are the
# browser's own, outside the page's policy), so a violation anywhere in a page is seen.
RECORD_VIOLATIONS = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  const where = `${e.sourceFile}:${e.lineNumber}`;
  window.cspViolations.push(`${e.effectiveDirective} refused ${e.blockedURI || "inline"} at ${where}`);
});
"""


def watched_page(browser, problems: list[str]):
    """A page whose script errors, console errors (Chromium logs each CSP refusal as one) and
    policy violations all land in `problems`."""
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.add_init_script(RECORD_VIOLATIONS)
    page.on("pageerror", lambda e: problems.append(f"{page.url}: {e}"))
    page.on("console", lambda m: console_error(m, problems, page.url))
    return page


def console_error(message, problems: list[str], url: str) -> None:
    # The site has no favicon; the browser's own request for one is not a page's fault.
    if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
        problems.append(f"{url}: {message.text} ({message.location.get('url')})")


def visit(page, url: str) -> None:
    answer = page.goto(url)
    assert answer.ok and "script-src 'self'" in answer.headers["content-security-policy"], url


def until(page, predicate: str, problems: list[str], timeout: int = 30_000) -> None:
    """wait_for_function that, when the page's script never gets there, says what was refused."""
    try:
        page.wait_for_function(predicate, timeout=timeout)
    except Exception:
        raise AssertionError(f"{page.url}: {predicate} never held; {violations(page) + problems}") from None


def violations(page) -> list[str]:
    return [f"{page.url}: {v}" for v in page.evaluate("window.cspViolations")]


def test_every_page_works_under_the_content_security_policy(server, browser, fleet):
    """The policy forbids inline script and style: each page's script still runs (live updates
    over websockets, the heatmap, the charts, the console's widgets, Swagger UI) and the browser
    refuses nothing."""
    job = make_job(fleet["alice"], fleet["queue"], name="watched")
    problems: list[str] = []
    page = watched_page(browser, problems)
    sign_in(page, server, "alice")
    refused = violations(page)
    live = "() => document.querySelector('#live').className === 'live on'"  # the websocket is up

    visit(page, f"{server}/")
    until(page, live, problems)
    refused += violations(page)

    visit(page, f"{server}/jobs/")
    until(page, live, problems)
    page.check("#all")  # the select-all box is the page script's
    assert all(page.eval_on_selector_all('input[name="job"]', "boxes => boxes.map((b) => b.checked)"))
    refused += violations(page)

    visit(page, f"{server}/jobs/{job.pk}/")
    until(page, live, problems)
    page.click('#job-actions button[data-action="hold"]')
    until(page, "() => document.querySelector('#job-state').textContent === 'HELD'", problems, timeout=10_000)
    refused += violations(page)

    visit(page, f"{server}/submit/")
    page.click('.tabs button[data-tab="yaml"]')
    assert page.is_visible("#submit-yaml") and not page.is_visible("#submit-form")
    refused += violations(page)

    for path in ("/fleet/", "/clusters/sim-a/"):
        visit(page, f"{server}{path}")
        until(page, "() => document.querySelector('#heatmap').dataset.nodes === '40'", problems)
        until(page, live, problems)
        page.wait_for_selector("#charts > *")  # uPlot's charts, or the note that there is no data yet
        assert page.evaluate("Orrery.cellColour('a007')") == "rgb(46, 158, 91)"
        # The legend's swatches are coloured through element.style, which the policy allows.
        assert (
            page.eval_on_selector_all("#legend i", "l => l.map((i) => i.style.background)")[0]
            == "rgb(46, 158, 91)"
        )
        refused += violations(page)

    visit(page, f"{server}/queues/")
    refused += violations(page)

    ops = watched_page(browser, problems)
    sign_in(ops, server, "ops")
    visit(ops, f"{server}/admin/")
    refused += violations(ops)
    visit(ops, f"{server}/admin/scheduling/job/")
    ops.check('input[name="_selected_action"] >> nth=0')
    ops.wait_for_selector("#result_list tr.selected")  # the actions script marked the row
    refused += violations(ops)
    operator = get_user_model().objects.get(username="ops")
    visit(ops, f"{server}/admin/auth/user/{operator.pk}/change/")
    ops.fill('input[name="last_login_0"]', "")
    ops.click(".datetimeshortcuts a >> nth=0")  # "Today" beside last login: the date widget's script
    assert ops.input_value('input[name="last_login_0"]') != ""
    refused += violations(ops)
    visit(ops, f"{server}/admin/portal/apitoken/add/")
    ops.click(".select2-selection")  # the user field's autocomplete
    ops.wait_for_selector(".select2-results__option")
    refused += violations(ops)
    visit(ops, f"{server}/api/docs/")
    ops.wait_for_selector(".swagger-ui .opblock", timeout=15_000)  # Swagger UI drew the API
    refused += violations(ops)

    assert refused == []
    assert problems == []
