"""API tokens: stored hashed, shown once, revocable, expiring, last-used tracked."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from foundation.secrets import digest
from portal.models import ApiToken
from portal.services.tokens import authenticate_token, issue_token, revoke_token

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
