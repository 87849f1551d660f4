"""A throwaway PostgreSQL database for one benchmark run: created, migrated, and dropped after.

Benchmarks run Orrery in-process against ``DATABASE_URL``'s server (default: loopback), each in
a database of its own named after the benchmark and the process, so two runs never share rows.
Benchmarks that set up the rest themselves (a Redis, server processes) use ``create_database`` and
``drop_database`` alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def throwaway_database(prefix: str) -> Iterator[str]:
    """Create ``<prefix>_<pid>``, point Django at it (in-process: no Redis, quiet logs, no
    periodic scheduler resync), migrate it, yield its URL; drop it afterwards, whatever
    happened."""
    base = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    name = f"{prefix}_{os.getpid()}"
    server = base.rsplit("/", 1)[0]
    os.environ.update(
        {
            "DATABASE_URL": f"{server}/{name}",
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "ORRERY_LOG_LEVEL": "WARNING",
            "ORRERY_SCHEDULER_RESYNC_S": "3600",
        }
    )
    os.environ.pop("REDIS_URL", None)  # the in-process heartbeat buffer and cache: one process
    admin = f"{server}/postgres"
    create_database(admin, name)
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        yield os.environ["DATABASE_URL"]
    finally:
        drop_database(admin, name)


def create_database(admin: str, name: str) -> None:
    """Create database ``name`` on the server of ``admin`` (a URL of its maintenance database)."""
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(admin: str, name: str) -> None:
    """Close this process's connections, then drop ``name`` whoever else is still connected."""
    import psycopg
    from django.db import connections

    connections.close_all()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
