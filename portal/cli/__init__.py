"""``orrery``: the command-line client of the Orrery API.

It uses only the standard library and PyYAML, so it installs anywhere the project does; it never
touches the database, only the REST API.
"""

from portal.cli.commands import main

__all__ = ["main"]
