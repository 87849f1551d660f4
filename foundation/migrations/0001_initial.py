"""The audit log, append-only in the database: triggers refuse UPDATE and DELETE on its rows on
PostgreSQL and on SQLite, whoever asks (the application, the console, a shell)."""

import django.utils.timezone
from django.db import migrations, models

POSTGRES = [
    """
    CREATE OR REPLACE FUNCTION orrery_audit_append_only() RETURNS trigger AS $$
    BEGIN
        RAISE EXCEPTION USING
            MESSAGE = 'audit entries are append-only (' || TG_OP || ' refused)',
            ERRCODE = 'integrity_constraint_violation';
    END;
    $$ LANGUAGE plpgsql;
    """,
    """
    CREATE TRIGGER auditentry_append_only BEFORE UPDATE OR DELETE ON foundation_auditentry
    FOR EACH ROW EXECUTE FUNCTION orrery_audit_append_only();
    """,
]
POSTGRES_DROP = [
    "DROP TRIGGER IF EXISTS auditentry_append_only ON foundation_auditentry;",
    "DROP FUNCTION IF EXISTS orrery_audit_append_only();",
]
SQLITE = [
    """
    CREATE TRIGGER auditentry_no_update BEFORE UPDATE ON foundation_auditentry
    BEGIN SELECT RAISE(ABORT, 'audit entries are append-only (UPDATE refused)'); END;
    """,
    """
    CREATE TRIGGER auditentry_no_delete BEFORE DELETE ON foundation_auditentry
    BEGIN SELECT RAISE(ABORT, 'audit entries are append-only (DELETE refused)'); END;
    """,
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS auditentry_no_update;", "DROP TRIGGER IF EXISTS auditentry_no_delete;"]


def _run(statements_by_vendor):
    def run(apps, schema_editor):
        for sql in statements_by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="AuditEntry",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("at", models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ("actor_id", models.BigIntegerField(blank=True, null=True)),
                ("actor_name", models.CharField(blank=True, max_length=150)),
                ("source", models.CharField(max_length=64)),
                (
                    "action",
                    models.CharField(
                        choices=[
                            ("job.submit", "Job submitted"),
                            ("job.cancel", "Job cancelled"),
                            ("job.hold", "Job held"),
                            ("job.release", "Job released"),
                            ("job.requeue", "Job requeued"),
                            ("node.drain", "Node drained"),
                            ("node.cordon", "Node cordoned"),
                            ("node.resume", "Node resumed"),
                            ("cluster.onboard", "Cluster onboarded"),
                            ("join_token.create", "Join token created"),
                            ("cluster_credential.create", "Collector credential created"),
                            ("credential.revoke", "Cluster or node credential revoked"),
                            ("token.create", "API token created"),
                            ("token.revoke", "API token revoked"),
                            ("account.map", "POSIX account mapped"),
                            ("account.unmap", "POSIX account unmapped"),
                        ],
                        max_length=40,
                    ),
                ),
                ("target", models.CharField(max_length=255)),
                ("details", models.JSONField(blank=True, default=dict)),
            ],
            options={
                "verbose_name": "audit entry",
                "verbose_name_plural": "audit log",
                "ordering": ["-id"],
                "indexes": [
                    models.Index(fields=["at"], name="audit_at"),
                    models.Index(fields=["action", "at"], name="audit_action_at"),
                    models.Index(fields=["actor_name", "at"], name="audit_actor_at"),
                    models.Index(fields=["target", "at"], name="audit_target_at"),
                ],
            },
        ),
        migrations.RunPython(
            _run({"postgresql": POSTGRES, "sqlite": SQLITE}),
            _run({"postgresql": POSTGRES_DROP, "sqlite": SQLITE_DROP}),
        ),
    ]
