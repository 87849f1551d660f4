"""Cluster secrets are sealed at rest, and keys rotate without losing one."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from clusters.models import ClusterSecret
from foundation.sealing import SealBroken, new_key, reseal, seal, unseal
from tests.factories import make_cluster

pytestmark = pytest.mark.django_db


def test_a_sealed_secret_opens_and_shows_nothing_in_clear():
    sealed = seal({"token": "eyJhbGciOi-secret-jwt"})
    assert "secret-jwt" not in sealed and "token" not in sealed
    assert unseal(sealed) == {"token": "eyJhbGciOi-secret-jwt"}


def test_the_database_holds_ciphertext_only():
    cluster = make_cluster("hpc", kind="slurm")
    ClusterSecret.objects.create(cluster=cluster, data={"token": "eyJhbGciOi-secret-jwt"})
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM clusters_clustersecret")
        row = " ".join(map(str, cursor.fetchone()))
    assert "secret-jwt" not in row
    assert ClusterSecret.objects.get(cluster=cluster).data == {"token": "eyJhbGciOi-secret-jwt"}


def test_keys_rotate_without_losing_a_secret(settings):
    old, new = settings.ORRERY_SECRETS_KEYS[0], new_key()
    cluster = make_cluster("hpc", kind="slurm")
    ClusterSecret.objects.create(cluster=cluster, data={"token": "t-1"})
    settings.ORRERY_SECRETS_KEYS = [new, old]  # the new key first: it seals, both open
    assert ClusterSecret.objects.get(cluster=cluster).data == {"token": "t-1"}
    out = StringIO()
    call_command("rotate_secrets", stdout=out)
    assert "Sealed 1 cluster secret" in out.getvalue()
    settings.ORRERY_SECRETS_KEYS = [new]  # the old key dropped
    assert ClusterSecret.objects.get(cluster=cluster).data == {"token": "t-1"}
    settings.ORRERY_SECRETS_KEYS = [old]  # only the old one: the rotated secret no longer opens
    with pytest.raises(SealBroken):
        ClusterSecret.objects.get(cluster=cluster).data  # noqa: B018


def test_an_altered_seal_is_refused():
    sealed = seal({"token": "t"})
    tampered = sealed[:-6] + ("A" if sealed[-6] != "A" else "B") + sealed[-5:]
    with pytest.raises(SealBroken):
        unseal(tampered)
    with pytest.raises(SealBroken):
        reseal(tampered)
