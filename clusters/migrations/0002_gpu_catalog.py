"""Seed the GPU model catalog. Idempotent: re-running updates the rows in place."""

from django.db import migrations

# slug, name, vendor, memory MiB (as the driver reports), TDP W, throughput vs A100-80G,
# aliases users type, vendor product strings nodes report.
CATALOG = [
    (
        "h200-141g",
        "NVIDIA H200 141GB",
        "nvidia",
        143771,
        700,
        3.0,
        ["h200"],
        ["NVIDIA H200", "NVIDIA H200 141GB HBM3e"],
    ),
    (
        "h100-80g",
        "NVIDIA H100 80GB",
        "nvidia",
        81559,
        700,
        2.5,
        ["h100", "h100-80gb"],
        ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100"],
    ),
    (
        "a100-80g",
        "NVIDIA A100 80GB",
        "nvidia",
        81920,
        400,
        1.0,
        ["a100", "a100-80gb"],
        ["NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"],
    ),
    (
        "a100-40g",
        "NVIDIA A100 40GB",
        "nvidia",
        40960,
        400,
        0.95,
        ["a100-40gb"],
        ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"],
    ),
    ("l40s-48g", "NVIDIA L40S", "nvidia", 46068, 350, 0.7, ["l40s"], ["NVIDIA L40S"]),
    ("a10-24g", "NVIDIA A10", "nvidia", 23028, 150, 0.25, ["a10"], ["NVIDIA A10"]),
    (
        "rtx4090-24g",
        "NVIDIA GeForce RTX 4090",
        "nvidia",
        24564,
        450,
        0.55,
        ["rtx4090", "4090", "rtx-4090"],
        ["NVIDIA GeForce RTX 4090"],
    ),
    (
        "mi300x-192g",
        "AMD Instinct MI300X",
        "amd",
        196608,
        750,
        2.4,
        ["mi300x"],
        ["AMD Instinct MI300X", "AMD Instinct MI300X OAM"],
    ),
]


def seed(apps, schema_editor):
    GpuModel = apps.get_model("clusters", "GpuModel")
    GpuModelAlias = apps.get_model("clusters", "GpuModelAlias")
    db = schema_editor.connection.alias
    for slug, name, vendor, memory_mb, tdp, throughput, aliases, products in CATALOG:
        model, _ = GpuModel.objects.using(db).update_or_create(
            slug=slug,
            defaults={
                "name": name,
                "vendor": vendor,
                "memory_mb": memory_mb,
                "tdp_watts": tdp,
                "relative_throughput": throughput,
            },
        )
        for kind, names in (("alias", aliases), ("product", products)):
            for alias in names:
                GpuModelAlias.objects.using(db).update_or_create(
                    name=alias.lower(), defaults={"gpu_model": model, "kind": kind}
                )


class Migration(migrations.Migration):
    dependencies = [("clusters", "0001_initial")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
