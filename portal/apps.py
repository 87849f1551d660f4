from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class PortalConfig(AppConfig):
    default = True
    name = "portal"
    verbose_name = "Projects and access"

    def ready(self) -> None:
        from portal import checks  # noqa: F401  (registers the deploy checks)

        # The body parsers refuse to load without libyaml, so a server whose PyYAML lacks it
        # fails at start-up instead of parsing YAML with the pure-Python loader (minutes a body).
        from portal.api import parsers  # noqa: F401


class OrreryAdminConfig(admin_apps.AdminConfig):
    """django.contrib.admin, with the console's landing page and scheduler page."""

    default = False
    default_site = "portal.console.OrreryAdminSite"
