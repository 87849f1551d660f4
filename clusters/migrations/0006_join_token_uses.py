from django.db import migrations, models


class Migration(migrations.Migration):
    """Join tokens get a use limit. Tokens issued before keep admitting any number of machines
    (their rows get no limit); new ones admit one unless their maker says otherwise."""

    dependencies = [
        ("clusters", "0005_node_fillfactor"),
    ]

    operations = [
        migrations.AddField(
            model_name="jointoken",
            name="max_uses",
            field=models.PositiveIntegerField(
                blank=True, null=True, help_text="How many machines it admits; empty: no limit."
            ),
        ),
        migrations.AlterField(
            model_name="jointoken",
            name="max_uses",
            field=models.PositiveIntegerField(
                blank=True, default=1, help_text="How many machines it admits; empty: no limit.", null=True
            ),
        ),
    ]
