"""Free space in node pages, so the rare full-fleet rewrites (a reboot storm, an agent upgrade)
can update rows in place (HOT) instead of touching every index."""

from django.db import migrations


def _fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE clusters_node SET (fillfactor = 80)")


class Migration(migrations.Migration):
    dependencies = [("clusters", "0004_lastseen_hot")]
    operations = [migrations.RunPython(_fillfactor, migrations.RunPython.noop)]
