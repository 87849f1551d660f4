from django.urls import path

from clusters.api import agent

app_name = "agent"
urlpatterns = [
    path("register", agent.register, name="register"),
    path("nodes", agent.inventory, name="nodes"),
    path("heartbeat", agent.heartbeat, name="heartbeat"),
    path("report", agent.report, name="report"),
]
