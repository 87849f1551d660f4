from django.contrib import admin
from django.urls import include, path

from portal import views

urlpatterns = [
    path("", views.fleet_summary, name="fleet-summary"),
    path("admin/", admin.site.urls),
    path("", include("django_prometheus.urls")),
]
