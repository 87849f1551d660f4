from django.db import migrations, models


def seal_existing(apps, schema_editor):
    """Seal what was stored in clear, then the clear column goes."""
    from foundation.sealing import seal

    ClusterSecret = apps.get_model("clusters", "ClusterSecret")
    for row in ClusterSecret.objects.using(schema_editor.connection.alias).all():
        row.sealed = seal(row.data or {})
        row.save(update_fields=["sealed"])


def unseal_existing(apps, schema_editor):
    from foundation.sealing import unseal

    ClusterSecret = apps.get_model("clusters", "ClusterSecret")
    for row in ClusterSecret.objects.using(schema_editor.connection.alias).all():
        row.data = unseal(row.sealed)
        row.save(update_fields=["data"])


class Migration(migrations.Migration):
    """Cluster secrets are sealed at rest (``foundation.sealing``)."""

    dependencies = [
        ("clusters", "0006_join_token_uses"),
    ]

    operations = [
        migrations.AddField(
            model_name="clustersecret",
            name="sealed",
            field=models.TextField(blank=True, editable=False),
        ),
        migrations.RunPython(seal_existing, unseal_existing),
        migrations.RemoveField(
            model_name="clustersecret",
            name="data",
        ),
    ]
