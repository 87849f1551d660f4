"""Personal API tokens get scopes and always expire.

Tokens issued before scopes existed could do everything their user could, so they get every
scope (nothing that worked stops working). Tokens that never expired now expire
``ORRERY_TOKEN_MAX_DAYS`` after this migration runs. Reversing drops the scopes and lets
``expires_at`` be empty again (the dates set here stay)."""

from datetime import timedelta

from django.conf import settings
from django.db import migrations, models
from django.utils import timezone

ALL_SCOPES = ["read", "submit", "operate"]


def backfill(apps, schema_editor):
    ApiToken = apps.get_model("portal", "ApiToken")
    ApiToken.objects.update(scopes=ALL_SCOPES)
    ApiToken.objects.filter(expires_at__isnull=True).update(
        expires_at=timezone.now() + timedelta(days=settings.ORRERY_TOKEN_MAX_DAYS)
    )
    if schema_editor.connection.vendor == "postgresql":
        # The updates queue deferred foreign-key checks; PostgreSQL refuses to alter a table with
        # checks pending, so run them now, before expires_at becomes NOT NULL.
        schema_editor.execute("SET CONSTRAINTS ALL IMMEDIATE")


class Migration(migrations.Migration):
    dependencies = [
        ("portal", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="scopes",
            field=models.JSONField(default=list),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(),
        ),
    ]
