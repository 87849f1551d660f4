"""What Django's debug pages and error e-mails may show of the settings.

Django hides settings whose *name* looks secret (``SECRET_KEY``, ``DATABASES[...]['PASSWORD']``),
but Orrery keeps its connection strings whole: ``DATABASE_URL``, ``REDIS_URL``,
``CELERY_BROKER_URL``, and the same Redis URL inside ``CACHES`` and ``CHANNEL_LAYERS``. The filter
below also redacts the password part of any URL in any value, however deep in dicts, lists and
tuples it sits; the request's ``META`` goes through the same function (under ``runserver`` it
carries the whole process environment), and so do the string variables of traceback frames.
"""

from __future__ import annotations

import re
from typing import Any

from django.views.debug import SafeExceptionReporterFilter

# scheme://user:PASSWORD@host — the password runs to the last "@" before whitespace, so an
# unencoded "@" inside it cannot leave a tail showing (over-redacting is the safe side).
URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/?#@]*:)(?P<password>[^\s]+)@")


def redact_url_passwords(text: str, substitute: str = "********") -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it replaced."""
    return URL_PASSWORD.sub(lambda m: f"{m['head']}{substitute}@", text)


def _redacted(value: Any, substitute: str) -> Any:
    # isinstance, not type(): lazy strings (a translated message, axes' username field) pass as
    # str and are shown as one; they are left as they are unless they hold a URL password.
    if not isinstance(value, str):
        return value
    text = str(value)
    redacted = redact_url_passwords(text, substitute)
    return value if redacted == text else redacted


class RedactingExceptionReporterFilter(SafeExceptionReporterFilter):
    """Django's filter, plus URL passwords redacted in every setting and ``META`` value."""

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        # The parent recurses into dicts, lists and tuples through this method, so strings at
        # every depth pass through here.
        return _redacted(super().cleanse_setting(key, value), self.cleansed_substitute)

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> Any:
        # A frame's string locals (a URL read from settings into a variable) get the same redaction.
        return [
            (name, _redacted(value, self.cleansed_substitute))
            for name, value in super().get_traceback_frame_variables(request, tb_frame)
        ]
