from django.urls import path, register_converter

from portal.api import accounting, notifications, views
from portal.api.budgets import BudgetListView
from scheduling.refs import PATTERN, JobRef, parse_ref


class JobRefConverter:
    """``74``, ``74_3`` or ``74_[1-5,9]`` (``scheduling.refs``); anything else matches no
    route (404), numbers out of range included."""

    regex = PATTERN

    def to_python(self, value: str) -> JobRef:
        return parse_ref(value)  # ValueError: no match

    def to_url(self, value: JobRef | int | str) -> str:
        return str(value)


register_converter(JobRefConverter, "jobref")

app_name = "api"
urlpatterns = [
    path("jobs", views.JobListView.as_view(), name="jobs"),
    path("jobs/batch", views.JobBatchView.as_view(), name="jobs-batch"),
    path("jobs/<jobref:ref>", views.JobDetailView.as_view(), name="job"),
    path("jobs/<jobref:ref>/events", views.JobEventsView.as_view(), name="job-events"),
    path("jobs/<jobref:ref>/logs", views.JobLogsView.as_view(), name="job-logs"),
    *[
        path(f"jobs/<jobref:ref>/{verb}", views.JobActionView.as_view(verb=verb), name=f"job-{verb}")
        for verb in views.JobActionView.services
    ],
    path("arrays/<int:pk>", views.ArrayDetailView.as_view(), name="array"),
    path("projects", views.ProjectListView.as_view(), name="projects"),
    path("queues", views.QueueListView.as_view(), name="queues"),
    path("clusters", views.ClusterListView.as_view(), name="clusters"),
    path("clusters/<str:name>", views.ClusterDetailView.as_view(), name="cluster"),
    path("clusters/<str:name>/accounts", views.ClusterAccountListView.as_view(), name="cluster-accounts"),
    path(
        "clusters/<str:name>/accounts/<str:username>",
        views.ClusterAccountView.as_view(),
        name="cluster-account",
    ),
    path("nodes", views.NodeListView.as_view(), name="nodes"),
    path("nodes/<int:pk>/events", views.NodeEventsView.as_view(), name="node-events"),
    path("gpu-models", views.GpuModelListView.as_view(), name="gpu-models"),
    path("me", views.MeView.as_view(), name="me"),
    path("tokens", views.TokenListView.as_view(), name="tokens"),
    path("tokens/<int:pk>", views.TokenDetailView.as_view(), name="token"),
    path("me/notifications", notifications.NotificationSettingsView.as_view(), name="notifications"),
    path(
        "me/notifications/rotate-secret",
        notifications.RotateSecretView.as_view(),
        name="notifications-rotate-secret",
    ),
    path("me/notifications/test", notifications.NotificationTestView.as_view(), name="notifications-test"),
    path("budgets", BudgetListView.as_view(), name="budgets"),
    # accounting
    path("accounting/jobs", accounting.HistoryView.as_view(), name="accounting-jobs"),
    path("accounting/usage", accounting.UsageView.as_view(), name="accounting-usage"),
]
