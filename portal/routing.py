"""Websocket routes of the live dashboards (``portal/consumers.py``)."""

from django.urls import path

from portal import consumers

websocket_urlpatterns = [
    path("ws/fleet/", consumers.FleetConsumer.as_asgi()),
    path("ws/clusters/<str:name>/", consumers.ClusterConsumer.as_asgi()),
    path("ws/jobs/", consumers.JobsConsumer.as_asgi()),
    path("ws/jobs/<int:job_id>/", consumers.JobConsumer.as_asgi()),
]
