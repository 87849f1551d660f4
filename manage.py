#!/usr/bin/env python
"""Django's command-line entry point for Orrery.

Run by a Python without Django (``python manage.py …`` outside the virtualenv), it runs itself
again with the project's virtualenv (``.venv/bin/python``, made by ``make demo``), so that the
commands the docs show work as written."""

import os
import sys
from pathlib import Path

VENV = Path(__file__).resolve().parent / ".venv"


def _use_the_virtualenv() -> None:
    """Run this command again with the virtualenv's Python when this one lacks Django; without
    a virtualenv, say how to make one. Returns only when Django can be imported here."""
    try:
        import django  # noqa: F401
    except ModuleNotFoundError:
        python = VENV / "bin" / "python"
        # A virtualenv's python is a link to the base interpreter: which one runs is told by
        # sys.prefix, not by the executable's path.
        if python.exists() and Path(sys.prefix).resolve() != VENV.resolve():
            os.execv(python, [str(python), *sys.argv])
        sys.exit(
            f"manage.py: this Python ({sys.executable}) has no Django and {VENV} holds no "
            "virtualenv with it: run `make venv` (or `make demo`) first"
        )


def main() -> None:
    _use_the_virtualenv()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    from django.core.management import execute_from_command_line

    from foundation import audit

    audit.set_source("cli")  # what commands change is recorded as done on the server's shell

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
