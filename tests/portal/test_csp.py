"""The Content-Security-Policy: every response carries it, and no HTML page needs what it forbids
(inline script, inline style, event-handler attributes, javascript: URLs). That pages still work
under it in a real browser is tests/portal/test_browser.py's part."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.contrib import admin
from django.urls import reverse

from portal.middleware import DEFAULT_CSP, render_csp
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import make_job

pytestmark = pytest.mark.django_db

POLICY = render_csp(DEFAULT_CSP)
DATA_SCRIPT_TYPES = {"application/json", "application/ld+json"}  # data, never run
MODELS = sorted(admin.site._registry, key=lambda m: m._meta.label)


class InlineCode(HTMLParser):
    """Collects everything in a page that a policy without 'unsafe-inline' refuses."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._in: str | None = None  # "script" or "style" while inside one with inline content

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        for name, value in attrs:
            if name.startswith("on"):
                self.found.append(f"<{tag} {name}=…>")
            if name == "style":
                self.found.append(f"<{tag} style={value!r}>")
            if name in ("href", "src", "action", "formaction") and (value or "").strip().lower().startswith(
                "javascript:"
            ):
                self.found.append(f"<{tag} {name}={value!r}>")
        if (
            tag == "script"
            and "src" not in named
            and (named.get("type") or "").lower() not in DATA_SCRIPT_TYPES
        ):
            self._in = "script"
        elif tag == "style":
            self._in = "style"

    def handle_endtag(self, tag: str) -> None:
        if tag == self._in:
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in and data.strip():
            self.found.append(f"<{self._in}>{data.strip()[:80]}")


def inline_code(html: str) -> list[str]:
    parser = InlineCode()
    parser.feed(html)
    parser.close()
    return parser.found


@pytest.mark.parametrize(
    ("html", "found"),
    [
        ("<script>Orrery.jobsPage();</script>", ["<script>Orrery.jobsPage();"]),
        ('<script src="/static/x.js"></script>', []),
        ('<script id="a" type="application/json">{"x": 1}</script>', []),
        ('<button onclick="go()">', ["<button onclick=…>"]),
        ('<span style="width: 3%">', ["<span style='width: 3%'>"]),
        ("<style>body { margin: 0 }</style>", ["<style>body { margin: 0 }"]),
        ('<a href="javascript:go()">', ["<a href='javascript:go()'>"]),
    ],
    ids=[
        "inline-script",
        "script-file",
        "json-script",
        "handler",
        "style-attribute",
        "style-element",
        "js-url",
    ],
)
def test_the_checker_sees_inline_code(html, found):
    assert inline_code(html) == found


@pytest.fixture
def world(alice, queue, node, operator):
    job = make_job(alice, queue, gpus=2)
    bind_job(job, [NodePlacement(node, [0, 1])])
    operator.is_superuser = True
    operator.save(update_fields=["is_superuser"])
    return job


def portal_pages(job) -> list[str]:
    return [
        "/",
        "/submit/",
        "/jobs/",
        f"/jobs/{job.pk}/",
        "/clusters/",
        "/clusters/sim-a/",
        "/fleet/",
        "/queues/",
    ]


def assert_strict(answer, path: str) -> None:
    assert answer.status_code == 200, path
    assert answer["Content-Security-Policy"] == POLICY, path
    assert inline_code(answer.content.decode()) == [], path


def test_the_policy_forbids_inline_code_and_foreign_origins():
    assert POLICY == (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    )


def test_portal_pages_carry_the_policy_and_no_inline_code(client, world, alice):
    client.force_login(alice)
    for path in portal_pages(world):
        assert_strict(client.get(path), path)


def test_the_job_page_passes_its_data_as_json_not_code(client, world, alice):
    client.force_login(alice)
    page = client.get(f"/jobs/{world.pk}/").content.decode()
    assert 'data-page="job"' in page and f'data-job="{world.pk}"' in page
    assert '<script id="action-sources" type="application/json">' in page


def test_the_cluster_page_names_its_cluster_in_a_data_attribute(client, world, alice):
    client.force_login(alice)
    page = client.get("/clusters/sim-a/").content.decode()
    assert 'data-page="fleet"' in page and 'data-cluster="sim-a"' in page


@pytest.mark.parametrize("path", ["/accounts/login/", "/admin/login/"], ids=["portal", "admin"])
def test_login_pages_carry_the_policy_and_no_inline_code(client, path):
    assert_strict(client.get(path), path)


@pytest.mark.parametrize(
    "name",
    ["admin:index", "admin:scheduler", "admin:portal_apitoken_add", "admin:clusters_cluster_onboard_slurm"],
)
def test_console_pages_carry_the_policy_and_no_inline_code(client, world, operator, name):
    client.force_login(operator)
    assert_strict(client.get(reverse(name)), name)


@pytest.mark.parametrize("model", MODELS, ids=[m._meta.label for m in MODELS])
def test_every_changelist_and_change_form_has_no_inline_code(client, world, operator, model):
    client.force_login(operator)
    opts = model._meta
    assert_strict(client.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")), opts.label)
    obj = model._default_manager.first()
    if obj is not None:
        assert_strict(
            client.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])), opts.label
        )


def test_the_api_reference_loads_its_initialiser_as_a_script_file(client):
    page = client.get("/api/docs/")
    assert_strict(page, "/api/docs/")
    assert '<script src="/api/docs/?script="></script>' in page.content.decode()
    script = client.get("/api/docs/?script=")
    assert script.status_code == 200 and script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle(" in script.content.decode()
    assert '"validatorUrl": null' in script.content.decode()  # no badge fetched from swagger.io


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/api/v1/jobs", 200),
        ("/api/v1/jobs", 401),
        ("/api/schema/", 200),
        ("/no-such-page/", 404),
        ("/static/portal/live.js", 200),
    ],
    ids=["api", "api-refused", "schema", "not-found", "static-file"],
)
def test_every_response_carries_the_policy(client, alice, path, status):
    if status == 200:
        client.force_login(alice)
    answer = client.get(path)
    assert answer.status_code == status
    assert answer["Content-Security-Policy"] == POLICY


def test_a_nul_refused_before_any_view_still_carries_the_policy(client):
    answer = client.get("/jobs/", {"q": "a\x00b"})
    assert answer.status_code == 400 and answer["Content-Security-Policy"] == POLICY


def test_the_site_may_set_its_own_policy_and_a_report_only_one(client, settings):
    settings.SECURE_CSP = {"default-src": ["'none'"]}
    settings.SECURE_CSP_REPORT_ONLY = {"default-src": ["'self'"], "report-uri": ["/csp-reports/"]}
    answer = client.get("/accounts/login/")
    assert answer["Content-Security-Policy"] == "default-src 'none'"
    assert answer["Content-Security-Policy-Report-Only"] == "default-src 'self'; report-uri /csp-reports/"
