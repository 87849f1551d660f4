"""The ``orrery`` command-line client (``orrery --help``). Job commands talk to the REST API."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("orrery")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orrery", description="Orrery: one control plane for many GPU clusters."
    )
    parser.add_argument("--version", action="version", version=f"orrery {_version()}")
    return parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    return 0
