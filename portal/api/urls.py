from django.urls import path

from portal.api import accounting, views

app_name = "api"
urlpatterns = [
    path("jobs", views.JobListView.as_view(), name="jobs"),
    path("jobs/batch", views.JobBatchView.as_view(), name="jobs-batch"),
    path("jobs/<int:pk>", views.JobDetailView.as_view(), name="job"),
    path("jobs/<int:pk>/events", views.JobEventsView.as_view(), name="job-events"),
    path("jobs/<int:pk>/logs", views.JobLogsView.as_view(), name="job-logs"),
    *[
        path(f"jobs/<int:pk>/{verb}", views.JobActionView.as_view(verb=verb), name=f"job-{verb}")
        for verb in views.JobActionView.services
    ],
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
    # accounting
    path("accounting/jobs", accounting.HistoryView.as_view(), name="accounting-jobs"),
    path("accounting/usage", accounting.UsageView.as_view(), name="accounting-usage"),
]
