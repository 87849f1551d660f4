"""The generation of the facts submission keeps per process (``foundation.facts``): one row whose
``generation`` takes a new random value, in the changing transaction, whenever a statement
changes the GPU catalog, the POSIX accounts or a cluster's name, kind or identity (and, from
``scheduling.0011``, which projects have budgets), so that processes keeping those facts know
when to read them again. A random value, not a sequence's: a sequence hands its numbers out
again after a restore or a failover brings an older state back, and a process could then take
the old facts for the new. PostgreSQL only: elsewhere nothing is kept and nothing needs the row.

The row is not a model: a test database's flush leaves it in place."""

from django.db import migrations

NEW = "(random() * 4e18)::bigint"  # 62 bits, drawn afresh for every change
TRIGGERS = {
    "clusters_cluster": "INSERT OR DELETE OR TRUNCATE OR UPDATE OF name, kind, identity",
    "clusters_gpumodel": "INSERT OR UPDATE OR DELETE OR TRUNCATE",
    "clusters_gpumodelalias": "INSERT OR UPDATE OR DELETE OR TRUNCATE",
    "clusters_posixaccount": "INSERT OR UPDATE OR DELETE OR TRUNCATE",
}

FORWARD = [
    "CREATE TABLE clusters_fleet_facts (id smallint PRIMARY KEY CHECK (id = 1), generation bigint NOT NULL)",
    f"INSERT INTO clusters_fleet_facts (id, generation) VALUES (1, {NEW})",
    f"""CREATE FUNCTION clusters_fleet_facts_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO clusters_fleet_facts (id, generation) VALUES (1, {NEW})
    ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation;
    RETURN NULL;
END
$$""",
    *(
        f"CREATE TRIGGER {table}_facts AFTER {events} ON {table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION clusters_fleet_facts_changed()"
        for table, events in TRIGGERS.items()
    ),
]

BACKWARD = [
    *(f"DROP TRIGGER IF EXISTS {table}_facts ON {table}" for table in TRIGGERS),
    "DROP FUNCTION IF EXISTS clusters_fleet_facts_changed()",
    "DROP TABLE IF EXISTS clusters_fleet_facts",
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
