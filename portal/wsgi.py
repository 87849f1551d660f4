"""WSGI entry point (HTTP only; websockets need the ASGI application).

The agent's hot endpoints take a fast path around Django's request cycle (see
``clusters.api.fastpath``); everything else is Django as usual.
"""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_application = get_wsgi_application()

from clusters.api.fastpath import AgentFastPath  # noqa: E402  (needs settings loaded)

application = AgentFastPath(django_application)
