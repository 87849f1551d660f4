"""Token scopes and lifetimes, tried as an attacker would: a read-only token that writes, a
submit token that does an operator's work, a token that mints a longer-lived or wider one."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import override_settings
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from clusters.models import Cluster, PosixAccount
from portal.models import ApiToken
from portal.services.tokens import issue_token
from scheduling.models import Job
from tests.factories import make_cluster
from tests.portal.api.conftest import error_paths, job_spec

API = "/api/v1"
ALL = ("read", "submit", "operate")


def bearer(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def client_with(user, scopes=ALL, days: int | None = None) -> tuple[APIClient, ApiToken]:
    token, plaintext = issue_token(user, name="attacker", scopes=scopes, expires_in_days=days)
    return bearer(plaintext), token


def refused_for_scope(response, scope: str) -> bool:
    body = response.json()
    return response.status_code == 403 and f"lacks the '{scope}' scope" in body["detail"]


# --- scopes on requests -----------------------------------------------------------------------


def test_a_read_token_reads_but_cannot_submit(alice, queue, fleet):
    client, _ = client_with(alice, scopes=["read"])
    assert client.get(f"{API}/jobs").status_code == 200
    assert client.get(f"{API}/me").status_code == 200
    submitted = client.post(f"{API}/jobs", json.dumps(job_spec()), content_type="application/json")
    assert refused_for_scope(submitted, "submit"), submitted.content
    batch = client.post(f"{API}/jobs/batch", {"jobs": [job_spec()]}, format="json")
    assert refused_for_scope(batch, "submit")
    assert not Job.objects.exists()


@pytest.mark.parametrize("verb", ["cancel", "hold", "release", "requeue"])
def test_a_read_token_cannot_act_on_jobs(alice, alice_job, verb):
    client, _ = client_with(alice, scopes=["read"])
    state = alice_job.state
    assert refused_for_scope(client.post(f"{API}/jobs/{alice_job.pk}/{verb}"), "submit")
    alice_job.refresh_from_db()
    assert alice_job.state == state


def test_a_read_token_cannot_make_or_revoke_tokens(alice):
    client, token = client_with(alice, scopes=["read"])
    before = ApiToken.objects.count()
    assert refused_for_scope(client.post(f"{API}/tokens", {"name": "x"}, format="json"), "submit")
    assert refused_for_scope(client.delete(f"{API}/tokens/{token.pk}"), "submit")
    assert ApiToken.objects.count() == before
    assert ApiToken.objects.get(pk=token.pk).revoked_at is None


def test_a_submit_token_submits_and_cancels(alice, queue, fleet):
    client, _ = client_with(alice, scopes=["submit"])
    submitted = client.post(f"{API}/jobs", json.dumps(job_spec()), content_type="application/json")
    assert submitted.status_code == 201, submitted.content
    job_id = submitted.json()["id"]
    assert client.post(f"{API}/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
    assert refused_for_scope(client.get(f"{API}/jobs/{job_id}"), "read")


def test_an_operators_submit_token_cannot_onboard_or_map_accounts(operator, alice):
    lab = make_cluster("lab")
    client, _ = client_with(operator, scopes=["read", "submit"])
    onboard = client.post(
        f"{API}/clusters",
        {"name": "hpc", "kind": "slurm", "url": "http://127.0.0.1:9", "token": "jwt"},
        format="json",
    )
    assert refused_for_scope(onboard, "operate"), onboard.content
    assert not Cluster.objects.filter(name="hpc").exists()
    url = f"{API}/clusters/lab/accounts/alice"
    assert refused_for_scope(client.put(url, {"username": "alice"}, format="json"), "operate")
    assert not PosixAccount.objects.exists()
    PosixAccount.objects.create(cluster=lab, user=alice, username="alice")
    assert refused_for_scope(client.delete(url), "operate")
    assert PosixAccount.objects.count() == 1
    assert client.get(f"{API}/clusters/lab/accounts").status_code == 200


def test_an_operators_operate_token_does_operators_work(operator, alice):
    make_cluster("lab")
    client, _ = client_with(operator, scopes=["operate"])
    made = client.put(f"{API}/clusters/lab/accounts/alice", {"username": "alice"}, format="json")
    assert made.status_code == 201, made.content
    bad = client.post(f"{API}/clusters", {"name": "hpc"}, format="json")
    assert bad.status_code == 400  # past the scope check, at the form's
    assert refused_for_scope(client.get(f"{API}/clusters"), "read")


def test_an_operate_scope_gives_a_user_no_operators_rights(alice):
    make_cluster("lab")
    client, _ = client_with(alice, scopes=ALL)
    refused = client.put(f"{API}/clusters/lab/accounts/alice", {"username": "alice"}, format="json")
    assert refused.status_code == 403 and "scope" not in refused.json()["detail"]


def test_sessions_are_not_limited_by_scopes(client, alice, queue, fleet):
    client.force_login(alice)
    submitted = client.post(f"{API}/jobs", json.dumps(job_spec()), content_type="application/json")
    assert submitted.status_code == 201


def _views():
    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                yield from walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern) and hasattr(p.callback, "cls"):
                yield prefix + str(p.pattern), p.callback.cls

    return [(route, view) for route, view in walk(get_resolver().url_patterns) if route.startswith("api/v1/")]


def test_every_write_view_of_the_api_names_its_scope():
    views = _views()
    assert len(views) > 10
    writers = [
        (route, view)
        for route, view in views
        if any(hasattr(view, m) for m in ("post", "put", "patch", "delete"))
    ]
    assert writers
    assert [route for route, view in writers if "write_scope" not in vars(view)] == []


# --- lifetimes and widening ---------------------------------------------------------------------


def test_a_one_day_token_cannot_mint_a_longer_one(alice):
    client, token = client_with(alice, days=1)
    for days in (2, 90):
        refused = client.post(f"{API}/tokens", {"name": "long", "expiresInDays": days}, format="json")
        assert refused.status_code == 400 and error_paths(refused) == ["expiresInDays"]
    assert ApiToken.objects.filter(name="long").count() == 0
    # without a lifetime, the new token expires with the one that made it
    made = client.post(f"{API}/tokens", {"name": "child"}, format="json")
    assert made.status_code == 201
    assert ApiToken.objects.get(pk=made.json()["id"]).expires_at == token.expires_at


def test_a_token_cannot_widen_its_scopes(alice):
    client, _ = client_with(alice, scopes=["read", "submit"])
    refused = client.post(f"{API}/tokens", {"scopes": ["read", "operate"]}, format="json")
    assert refused.status_code == 400 and error_paths(refused) == ["scopes"]
    assert "'operate'" in refused.json()["errors"][0]["message"]
    assert not [t for t in ApiToken.objects.all() if "operate" in t.scopes]
    narrower = client.post(f"{API}/tokens", {"scopes": ["read"]}, format="json")
    assert narrower.status_code == 201 and narrower.json()["scopes"] == ["read"]


def test_default_scopes_are_read_and_submit_narrowed_to_the_callers(alice, client):
    client.force_login(alice)
    assert client.post(f"{API}/tokens", {}, content_type="application/json").json()["scopes"] == [
        "read",
        "submit",
    ]
    submit_only, _ = client_with(alice, scopes=["submit"])
    assert submit_only.post(f"{API}/tokens", {}, format="json").json()["scopes"] == ["submit"]


@override_settings(ORRERY_TOKEN_MAX_DAYS=30)
def test_the_site_maximum_bounds_every_token(alice, client):
    client.force_login(alice)  # a session: no calling token to cap it, only the site
    refused = client.post(f"{API}/tokens", {"expiresInDays": 31}, content_type="application/json")
    assert refused.status_code == 400 and error_paths(refused) == ["expiresInDays"]
    assert "30" in refused.json()["errors"][0]["message"]
    made = client.post(f"{API}/tokens", {}, content_type="application/json")
    assert made.status_code == 201
    expires = ApiToken.objects.get(pk=made.json()["id"]).expires_at
    assert timedelta(days=29, hours=23) < expires - timezone.now() <= timedelta(days=30)


@pytest.mark.parametrize(
    "scopes",
    [[], ["admin"], "read", [1], ["read", "read", "read", "read"], [None]],
    ids=["empty", "unknown", "not-a-list", "number", "too-many", "null"],
)
def test_bad_scopes_are_a_400_at_scopes(alice, scopes):
    client, _ = client_with(alice)
    before = ApiToken.objects.count()
    refused = client.post(f"{API}/tokens", {"scopes": scopes}, format="json")
    assert refused.status_code == 400, refused.content
    assert all(path.startswith("scopes") for path in error_paths(refused))
    assert ApiToken.objects.count() == before


def test_an_expired_token_is_refused(alice):
    client, token = client_with(alice)
    assert client.get(f"{API}/me").status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    refused = client.get(f"{API}/me")
    assert refused.status_code == 401 and "expired" in refused.json()["detail"]


def test_the_list_shows_scopes_expiry_and_last_use(alice):
    client, token = client_with(alice, scopes=["read", "submit"], days=7)
    client.get(f"{API}/me")
    [row] = [r for r in client.get(f"{API}/tokens").json()["results"] if r["id"] == token.pk]
    assert row["scopes"] == ["read", "submit"]
    assert row["expiresAt"] is not None and row["lastUsedAt"] is not None
    stored = ApiToken.objects.get(pk=token.pk)
    assert row["expiresAt"].startswith(stored.expires_at.strftime("%Y-%m-%dT%H:%M"))
