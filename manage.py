#!/usr/bin/env python
"""Django's command-line entry point for Orrery."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    from django.core.management import execute_from_command_line

    from foundation import audit

    audit.set_source("cli")  # what commands change is recorded as done on the server's shell

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
