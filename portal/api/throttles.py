"""Per-user rate limits (DRF throttling on the default cache: Redis when configured, so the
limit holds across every API process). Over the limit: 429 with ``Retry-After``."""

from rest_framework.throttling import AnonRateThrottle, UserRateThrottle


class SubmitThrottle(UserRateThrottle):
    scope = "submit"


class ReadThrottle(UserRateThrottle):
    scope = "read"


class AnonymousThrottle(AnonRateThrottle):
    scope = "anon"
