from django.urls import path

from clusters.api.agent import ENDPOINTS, django_view

app_name = "agent"
urlpatterns = [path(name, django_view(name), name=name) for name in ENDPOINTS]
