"""``orrery-agent`` / ``python -m clusters.agent``: the node agent's entry point."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from clusters.agent.agent import VERSION, Agent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orrery-agent", description="Orrery node agent.")
    parser.add_argument("--version", action="version", version=f"orrery-agent {VERSION}")
    parser.add_argument("--server", required=True, help="e.g. http://orrery.example.org")
    parser.add_argument("--join-token", help="needed the first time, to get this node's credential")
    parser.add_argument("--name", help="node name (default: the host name)")
    parser.add_argument("--fake-gpus", help="MODEL:COUNT, for machines without GPUs, e.g. a100:2")
    parser.add_argument("--work-dir", default="/var/lib/orrery-agent", type=Path)
    parser.add_argument("--labels", default="", help="k=v,k=v")
    parser.add_argument("--address", help="address other nodes reach this one at (gang jobs' head)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--once", action="store_true", help="one round, then exit (for checks)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    labels = dict(item.split("=", 1) for item in args.labels.split(",") if "=" in item)
    agent = Agent(
        args.server,
        args.work_dir,
        join_token=args.join_token,
        name=args.name,
        fake_gpus=args.fake_gpus,
        labels=labels,
        address=args.address,
        grace=args.grace,
    )
    if args.once:
        agent.step()
        return 0
    try:
        agent.run_forever()
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
