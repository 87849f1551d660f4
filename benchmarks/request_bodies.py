#!/usr/bin/env python
"""Request-body benchmark: how long the API's YAML parser spends on honest and hostile bodies.

    python benchmarks/request_bodies.py

Feeds ``portal.api.parsers.YamlParser`` (what every YAML request goes through) a 1,000-spec
batch, an 8.5 MiB body, a million-value list just under the size limit, an anchor bomb and
100,000 levels of nesting, three times each, and prints one JSON object: per body its size,
what the parser answered and the median time. The yardstick is the bare work of the honest
case in the same run: libyaml's safe loader building the same batch with no checks at all;
``batch_ratio`` is the parser's time over it. Hostile bodies are judged by their outcome (a
refusal) and by being refused in far less time than the batch takes to parse. Nothing is
asserted here.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.setdefault("ORRERY_DATA_DIR", tempfile.mkdtemp(prefix="orrery-bench-"))

import django

django.setup()

import yaml  # noqa: E402
from django.core.exceptions import RequestDataTooBig  # noqa: E402
from rest_framework.exceptions import ParseError  # noqa: E402

from portal.api.parsers import YamlParser  # noqa: E402

SPEC = (
    "- apiVersion: orrery/v1\n  metadata: {name: t%d, project: vision}\n"
    "  spec: {queue: default, resources: {gpus: 'h100:8', cpus: 32, memory: 256Gi}, timeLimit: 2h, "
    "run: python train.py --lr 0.1}\n"
)


def bodies() -> dict[str, bytes]:
    line = b"- " + b"x" * 60 + b"\n"
    bomb = b'a: &a ["x","x","x","x","x","x","x","x","x","x"]\n' + b"".join(
        b"%s: &%s [%s]\n"
        % (chr(98 + i).encode(), chr(98 + i).encode(), b",".join([b"*" + chr(97 + i).encode()] * 10))
        for i in range(9)
    )
    return {
        "batch_1000_specs": "".join(SPEC % i for i in range(1000)).encode(),
        "oversized_8.5MiB": line * (int(8.5 * 2**20) // len(line)),
        "wide_1M_values": b"".join(b"- %d\n" % i for i in range(1_000_000))[: 8 * 2**20 - 16],
        "anchor_bomb_10^10": bomb,
        "deep_100k_levels": b"[" * 100_000 + b"]" * 100_000,
    }


def parse_once(body: bytes) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        YamlParser().parse(io.BytesIO(body), "application/yaml", {})
        outcome = "parsed"
    except RequestDataTooBig:
        outcome = "413 too large"
    except ParseError as exc:
        outcome = f"400 {type(exc).__name__}"
    return time.perf_counter() - started, outcome


def main() -> None:
    report: dict[str, object] = {}
    for name, body in bodies().items():
        runs = [parse_once(body) for _ in range(3)]
        report[name] = {
            "bytes": len(body),
            "outcome": runs[0][1],
            "median_s": round(statistics.median(t for t, _ in runs), 4),
        }
    batch = bodies()["batch_1000_specs"]
    bare = []
    for _ in range(3):
        started = time.perf_counter()
        yaml.load(batch, Loader=yaml.CSafeLoader)
        bare.append(time.perf_counter() - started)
    report["yardstick_bare_csafeloader_batch_s"] = round(statistics.median(bare), 4)
    report["batch_ratio"] = round(report["batch_1000_specs"]["median_s"] / statistics.median(bare), 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
