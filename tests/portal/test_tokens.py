"""API tokens: stored hashed, shown once, revocable, always expiring, scoped, last-used tracked.
The attacks through the API are in ``tests/portal/api/test_scopes.py``."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from foundation.secrets import digest
from portal.models import ApiToken
from portal.services.tokens import TokenRefused, authenticate_token, issue_token, revoke_token
from tests.factories import make_user

pytestmark = pytest.mark.django_db


def test_only_the_digest_is_stored(alice):
    token, plaintext = issue_token(alice, name="ci")
    row = ApiToken.objects.get(pk=token.pk)
    assert plaintext not in {row.digest, row.prefix, row.name}
    assert row.digest == digest(plaintext) and plaintext.startswith(row.prefix)


def test_authenticate_finds_the_user_and_records_use(alice):
    _, plaintext = issue_token(alice)
    found = authenticate_token(plaintext)
    assert found is not None and found.user == alice
    assert ApiToken.objects.get(pk=found.pk).last_used_at is not None


@pytest.mark.parametrize("guess", ["", "orr_", "orr_nope", "Bearer x", "x" * 500])
def test_unknown_tokens_authenticate_nobody(alice, guess):
    issue_token(alice)
    assert authenticate_token(guess) is None


def test_revoked_and_expired_tokens_stop_working(alice):
    revoked, revoked_text = issue_token(alice)
    expired, expired_text = issue_token(alice)
    revoke_token(revoked)
    ApiToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert authenticate_token(revoked_text) is None
    assert authenticate_token(expired_text) is None
    first = ApiToken.objects.get(pk=revoked.pk).revoked_at
    revoke_token(revoked)  # idempotent
    assert ApiToken.objects.get(pk=revoked.pk).revoked_at == first


def test_inactive_users_tokens_stop_working(alice):
    _, plaintext = issue_token(alice)
    alice.is_active = False
    alice.save()
    assert authenticate_token(plaintext) is None


# --- lifetimes and scopes -------------------------------------------------------------------------


@override_settings(ORRERY_TOKEN_MAX_DAYS=10)
def test_every_token_expires_by_default_at_the_site_maximum(alice):
    token, _ = issue_token(alice)
    assert timedelta(days=9, hours=23) < token.expires_at - timezone.now() <= timedelta(days=10)
    assert token.scopes == ["read", "submit"]


@override_settings(ORRERY_TOKEN_MAX_DAYS=10)
@pytest.mark.parametrize("days", [0, 11, 10**6])
def test_lifetimes_outside_the_site_maximum_are_refused(alice, days):
    with pytest.raises(TokenRefused) as refused:
        issue_token(alice, expires_in_days=days)
    assert refused.value.field == "expiresInDays"
    assert not ApiToken.objects.exists()


def test_a_token_made_by_a_token_never_outlives_it_nor_widens_it(alice):
    parent, _ = issue_token(alice, scopes=["read", "submit"], expires_in_days=1)
    child, _ = issue_token(alice, issuer=parent)
    assert child.expires_at == parent.expires_at and child.scopes == ["read", "submit"]
    for kwargs, field in (({"expires_in_days": 2}, "expiresInDays"), ({"scopes": ["operate"]}, "scopes")):
        with pytest.raises(TokenRefused) as refused:
            issue_token(alice, issuer=parent, **kwargs)
        assert refused.value.field == field
    assert ApiToken.objects.count() == 2


def test_the_issue_token_command_sets_scopes_and_refuses_bad_ones(alice):
    out = io.StringIO()
    call_command("issue_token", "alice", "--scopes", "operate,read", "--expires-in-days", "3", stdout=out)
    token = authenticate_token(out.getvalue().strip())
    assert token.scopes == ["read", "operate"]
    assert token.expires_at - timezone.now() <= timedelta(days=3)
    for bad in (["--scopes", "root"], ["--expires-in-days", "100000"]):
        with pytest.raises(CommandError):
            call_command("issue_token", "alice", *bad, stdout=io.StringIO())
    assert ApiToken.objects.count() == 1


# --- the console ------------------------------------------------------------------------------------


@pytest.fixture
def console(client):
    client.force_login(make_user("root", staff=True))
    return client


def test_the_console_issues_scoped_tokens_and_lists_scopes_expiry_and_last_use(console, alice):
    response = console.post(
        reverse("admin:portal_apitoken_add"),
        {"user": alice.pk, "name": "deploy", "scopes": ["read", "operate"], "expires_in_days": "5"},
        follow=True,
    )
    assert "copy it now" in response.content.decode()
    token = alice.api_tokens.get()
    assert token.scopes == ["read", "operate"]
    assert token.expires_at - timezone.now() <= timedelta(days=5)
    page = console.get(reverse("admin:portal_apitoken_changelist")).content.decode()
    assert "read, operate" in page and "Expires at" in page and "Last used at" in page


@override_settings(ORRERY_TOKEN_MAX_DAYS=30)
def test_the_console_refuses_tokens_past_the_site_maximum(console, alice):
    response = console.post(
        reverse("admin:portal_apitoken_add"),
        {"user": alice.pk, "name": "forever", "scopes": ["read"], "expires_in_days": "31"},
    )
    assert response.status_code == 200 and "between 1 and 30" in response.content.decode()
    assert not ApiToken.objects.exists()


# --- the migration ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_migration_gives_old_tokens_every_scope_and_an_expiry_and_reverses():
    executor = MigrationExecutor(connection)
    executor.migrate([("portal", "0001_initial")])
    apps = executor.loader.project_state([("portal", "0001_initial")]).apps
    user = apps.get_model("auth", "User").objects.create(username="old")
    apps.get_model("portal", "ApiToken").objects.create(user=user, prefix="orr_old", digest="d" * 64)
    try:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())
        old = ApiToken.objects.get(prefix="orr_old")
        assert old.scopes == ["read", "submit", "operate"]
        assert old.expires_at > timezone.now() + timedelta(days=89)
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate([("portal", "0001_initial")])  # reversible
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())
