from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from portal import notifications, pages, scrape, usage
from portal.budgets import budget_list

urlpatterns = [
    path("", pages.dashboard, name="dashboard"),
    path("submit/", pages.submit, name="submit"),
    path("jobs/", pages.jobs, name="jobs"),
    path("jobs/cancel/", pages.bulk_cancel, name="bulk-cancel"),
    path("jobs/<int:pk>/", pages.job_detail, name="job"),
    path("clusters/", pages.clusters, name="clusters"),
    path("clusters/<str:name>/", pages.cluster_detail, name="cluster"),
    path("fleet/", pages.fleet, name="fleet"),
    path("fleet/nodes.json", pages.fleet_data, name="fleet-data"),
    path("fleet/series.json", pages.fleet_series, name="fleet-series"),
    path("queues/", pages.queues, name="queues"),
    path("settings/notifications/", notifications.notification_settings, name="notification-settings"),
    path("budgets/", budget_list, name="budgets"),
    path("usage/", usage.usage_page, name="usage"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/v1/agent/", include("clusters.api.urls")),
    path("api/v1/", include("portal.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves its initialiser as a script of its own (?script): no inline script.
    path(
        "api/docs/",
        SpectacularSwaggerSplitView.as_view(url_name="schema", template_name="portal/api_docs.html"),
        name="api-docs",
    ),
    path("metrics", scrape.metrics, name="prometheus-django-metrics"),
    path("metrics/gpus", scrape.gpu_metrics, name="gpu-metrics"),
]
