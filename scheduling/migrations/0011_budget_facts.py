"""Which projects have GPU-hour budgets is one of the facts submission keeps per process
(``foundation.facts``): a statement that adds, removes or moves a budget gives the facts a new
generation (``clusters.0013``'s trigger function). A reservation or a charge, which updates only
a budget's amounts, does not. PostgreSQL only."""

from django.db import migrations

FORWARD = (
    "CREATE TRIGGER scheduling_budget_facts "
    "AFTER INSERT OR DELETE OR TRUNCATE OR UPDATE OF project_id, queue_id ON scheduling_budget "
    "FOR EACH STATEMENT EXECUTE FUNCTION clusters_fleet_facts_changed()"
)
BACKWARD = "DROP TRIGGER IF EXISTS scheduling_budget_facts ON scheduling_budget"


def _run(statement):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0010_fine_grained_gpus_energy"),
        ("clusters", "0013_fleet_facts_generation"),
    ]
    operations = [migrations.RunPython(_run(FORWARD), _run(BACKWARD))]
