"""``orrery-agent`` / ``python -m clusters.agent``: the node agent's entry point."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def main(argv: list[str] | None = None) -> int:
    try:
        release = version("orrery")
    except PackageNotFoundError:
        release = "unknown"
    parser = argparse.ArgumentParser(prog="orrery-agent", description="Orrery node agent.")
    parser.add_argument("--version", action="version", version=f"orrery-agent {release}")
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
