"""Job events are append-only: the database refuses UPDATE on them, whoever asks."""

from django.db import migrations

POSTGRES = [
    """
    CREATE OR REPLACE FUNCTION orrery_refuse_update() RETURNS trigger AS $$
    BEGIN
        RAISE EXCEPTION 'job events are append-only' USING ERRCODE = 'integrity_constraint_violation';
    END;
    $$ LANGUAGE plpgsql;
    """,
    """
    CREATE TRIGGER jobevent_append_only BEFORE UPDATE ON scheduling_jobevent
    FOR EACH ROW EXECUTE FUNCTION orrery_refuse_update();
    """,
]
POSTGRES_DROP = [
    "DROP TRIGGER IF EXISTS jobevent_append_only ON scheduling_jobevent;",
    "DROP FUNCTION IF EXISTS orrery_refuse_update();",
]
SQLITE = [
    """
    CREATE TRIGGER jobevent_append_only BEFORE UPDATE ON scheduling_jobevent
    BEGIN SELECT RAISE(ABORT, 'job events are append-only'); END;
    """,
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS jobevent_append_only;"]


def _run(statements_by_vendor):
    def run(apps, schema_editor):
        for sql in statements_by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0001_initial")]
    operations = [
        migrations.RunPython(
            _run({"postgresql": POSTGRES, "sqlite": SQLITE}),
            _run({"postgresql": POSTGRES_DROP, "sqlite": SQLITE_DROP}),
        )
    ]
