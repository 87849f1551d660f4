"""``orrery-agent`` / ``python -m clusters.agent``: the node agent's entry point."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from clusters.agent import mig
from clusters.agent.agent import VERSION, Agent
from clusters.agent.telemetry import FAKE_POWER_W

# What `manage.py create_join_token` prints: the prefix and 43 URL-safe characters (256 bits).
JOIN_TOKEN = re.compile(r"orj_[A-Za-z0-9_-]{43}")


def read_join_token(path: Path | None, from_environment: str | None) -> str | None:
    """The join token from ``path`` (else the environment), None without one. One that cannot
    be read or is not a join token ends the agent at once with a one-line error (exit status 1):
    sent anyway, it would only be refused, again and again, or trip up the HTTP client."""
    if path is None:
        if not from_environment:
            return None
        token, where = from_environment, "ORRERY_JOIN_TOKEN"
    else:
        where = str(path)
        try:
            token = path.read_bytes().decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"orrery-agent: cannot read the join token from {where}: {exc}") from None
    token = token.strip()
    if not JOIN_TOKEN.fullmatch(token):
        raise SystemExit(
            f"orrery-agent: the join token in {where} is malformed: a join token is 'orj_' and 43 "
            "letters, digits, '-' or '_', as `manage.py create_join_token` prints it"
        )
    return token


def fake_mig(value: str) -> dict[int, list[str]]:
    try:
        return mig.parse_fake_mig(value)
    except mig.LayoutError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fake_power(value: str) -> tuple[float, float]:
    idle, colon, busy = value.partition(":")
    try:
        watts = (float(idle), float(busy))
    except ValueError:
        watts = (-1.0, -1.0)
    if not colon or not all(0 <= w <= 10_000 for w in watts) or watts[0] > watts[1]:
        raise argparse.ArgumentTypeError(f"{value[:40]!r}: expected IDLE:BUSY watts, e.g. 60:400")
    return watts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orrery-agent", description="Orrery node agent.")
    parser.add_argument("--version", action="version", version=f"orrery-agent {VERSION}")
    parser.add_argument("--server", required=True, help="e.g. http://orrery.example.org")
    parser.add_argument(
        "--join-token-file",
        type=Path,
        help="a file holding the join token, needed the first time to get this node's credential "
        "(or the environment variable ORRERY_JOIN_TOKEN; never on the command line, where any "
        "local user could read it)",
    )
    parser.add_argument("--name", help="node name (default: the host name)")
    parser.add_argument("--fake-gpus", help="MODEL:COUNT, for machines without GPUs, e.g. a100:2")
    parser.add_argument(
        "--fake-mig",
        type=fake_mig,
        help="MIG layouts of fake GPUs, GPU:PROFILE,PROFILE… separated by ';', e.g. "
        "'0:1g.10gb,1g.10gb,3g.40gb;1:7g.80gb' (the others are not in MIG mode)",
    )
    parser.add_argument(
        "--fake-power",
        type=fake_power,
        default=FAKE_POWER_W,
        help="IDLE:BUSY watts a fake GPU draws, idle and while an attempt holds it (default 60:400)",
    )
    parser.add_argument("--work-dir", default="/var/lib/orrery-agent", type=Path)
    parser.add_argument("--labels", default="", help="k=v,k=v")
    parser.add_argument("--address", help="address other nodes reach this one at (gang jobs' head)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument(
        "--lease",
        type=float,
        help="seconds without an answered heartbeat before this node stops all its attempts "
        "(default: the server's node failover time less the grace and two heartbeat intervals; "
        "a longer one is refused)",
    )
    parser.add_argument(
        "--retention",
        type=float,
        default=3600.0,
        help="seconds an ended attempt's directories are kept once reported and shipped (default 3600)",
    )
    parser.add_argument(
        "--shared-user",
        default="nobody",
        help="the account work runs as on clusters with a shared identity (default nobody)",
    )
    parser.add_argument(
        "--podman-arg",
        action="append",
        default=[],
        help="an extra argument for every `podman run` (repeat it), e.g. --podman-arg=--runtime=runc",
    )
    parser.add_argument("--no-cgroups", action="store_true", help="process groups only (not isolated)")
    parser.add_argument("--once", action="store_true", help="one round, then exit (for checks)")
    args = parser.parse_args(argv)
    if args.fake_mig and not args.fake_gpus:
        parser.error("--fake-mig needs --fake-gpus")
    count = (args.fake_gpus.partition(":")[2] or "1") if args.fake_gpus else "0"
    if not count.isdigit():
        parser.error(f"--fake-gpus {args.fake_gpus[:40]}: expected MODEL:COUNT, e.g. a100:2")
    if args.fake_mig and max(args.fake_mig) >= int(count):
        parser.error(f"--fake-mig: no GPU {max(args.fake_mig)} among the {count} fake ones")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    labels = dict(item.split("=", 1) for item in args.labels.split(",") if "=" in item)
    join_token = read_join_token(args.join_token_file, os.environ.pop("ORRERY_JOIN_TOKEN", None))
    agent = Agent(
        args.server,
        args.work_dir,
        join_token=join_token,
        name=args.name,
        fake_gpus=args.fake_gpus,
        fake_mig=args.fake_mig,
        fake_power=args.fake_power,
        labels=labels,
        address=args.address,
        grace=args.grace,
        lease=args.lease,
        retention=args.retention,
        shared_user=args.shared_user,
        podman_args=tuple(args.podman_arg),
        use_cgroups=not args.no_cgroups,
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
