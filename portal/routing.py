"""Websocket routes. The live dashboards' consumers are added here (fleet, cluster, job)."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
