"""WSGI entry point (HTTP only; websockets need the ASGI application).

The agent's hot endpoints and job submission take fast paths around Django's request cycle (see
``clusters.api.fastpath`` and ``portal.api.fastpath``); everything else is Django as usual.
"""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_application = get_wsgi_application()

from clusters.api.fastpath import AgentFastPath  # noqa: E402  (needs settings loaded)
from portal.api.fastpath import SubmissionFastPath  # noqa: E402

application = AgentFastPath(SubmissionFastPath(django_application))
