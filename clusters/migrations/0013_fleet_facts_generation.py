"""The generation of the facts submission keeps per process (``foundation.facts``): one row whose
``generation`` takes a new sequence value, in the changing transaction, whenever a statement
changes the clusters, the GPU catalog or the POSIX accounts (and, from ``scheduling.0011``, which
projects have budgets), so that processes keeping those facts know when to read them again.
PostgreSQL only: elsewhere nothing is kept and nothing needs the row.

The row is not a model: a test database's flush leaves it in place, and its values, never
reused, stay unique across flushes and rollbacks."""

from django.db import migrations

TABLES = ("clusters_cluster", "clusters_gpumodel", "clusters_gpumodelalias", "clusters_posixaccount")

FORWARD = [
    "CREATE SEQUENCE clusters_fleet_facts_seq",
    "CREATE TABLE clusters_fleet_facts (id smallint PRIMARY KEY CHECK (id = 1), generation bigint NOT NULL)",
    "INSERT INTO clusters_fleet_facts (id, generation) VALUES (1, nextval('clusters_fleet_facts_seq'))",
    """CREATE FUNCTION clusters_fleet_facts_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO clusters_fleet_facts (id, generation) VALUES (1, nextval('clusters_fleet_facts_seq'))
    ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation;
    RETURN NULL;
END
$$""",
    *(
        f"CREATE TRIGGER {table}_facts AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION clusters_fleet_facts_changed()"
        for table in TABLES
    ),
]

BACKWARD = [
    *(f"DROP TRIGGER IF EXISTS {table}_facts ON {table}" for table in TABLES),
    "DROP FUNCTION IF EXISTS clusters_fleet_facts_changed()",
    "DROP TABLE IF EXISTS clusters_fleet_facts",
    "DROP SEQUENCE IF EXISTS clusters_fleet_facts_seq",
]


def _run(statements):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            for statement in statements:
                schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [("clusters", "0012_node_half_pages")]
    operations = [migrations.RunPython(_run(FORWARD), _run(BACKWARD))]
