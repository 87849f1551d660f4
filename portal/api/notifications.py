"""Your notification settings over the API: ``/api/v1/me/notifications``.

``GET`` shows them (never the webhook secret: only whether one is set); ``PUT`` replaces them
(fields left out keep their value) and, when it sets a new webhook URL, answers with the new
secret this once; ``POST …/rotate-secret`` makes a new secret (shown once); ``POST …/test``
queues a test message on every channel set up.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api.errors import InputError
from portal.api.schema import ERROR_SCHEMA
from portal.api.throttles import ReadThrottle, SubmitThrottle
from portal.choices import Scope
from scheduling.choices import SUBSCRIBABLE_EVENTS
from scheduling.models import NotificationSetting
from scheduling.services.notifications import (
    SettingsRefused,
    rotate_secret,
    save_settings,
    send_test,
    settings_of,
)

ERRORS = {code: OpenApiResponse(ERROR_SCHEMA) for code in (400, 401, 403, 429)}


class NotificationSettingSerializer(serializers.Serializer):
    """The settings as their owner sees them."""

    email = serializers.BooleanField(help_text="Email the account's address.")
    emailAddress = serializers.CharField(source="user.email", help_text="Where email goes (the account's).")
    webhookUrl = serializers.CharField(source="webhook_url", help_text="Empty: no webhook.")
    webhookSecretSet = serializers.SerializerMethodField()
    events = serializers.ListField(child=serializers.ChoiceField(choices=SUBSCRIBABLE_EVENTS))
    updatedAt = serializers.DateTimeField(source="updated_at", allow_null=True)

    def get_webhookSecretSet(self, setting: NotificationSetting) -> bool:
        return bool(setting.webhook_secret)


class SavedSettingSerializer(NotificationSettingSerializer):
    webhookSecret = serializers.CharField(
        required=False, help_text="Only when this request made a new secret: shown this once."
    )


class NotificationSettingRequestSerializer(serializers.Serializer):
    """``PUT me/notifications``: a field left out keeps its value."""

    email = serializers.BooleanField(required=False)
    webhookUrl = serializers.CharField(
        max_length=500,
        allow_blank=True,
        required=False,
        help_text="http(s) URL to a public address; empty removes the webhook.",
    )
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=SUBSCRIBABLE_EVENTS),
        max_length=len(SUBSCRIBABLE_EVENTS),
        required=False,
    )


def _shown(setting: NotificationSetting, secret: str | None = None) -> dict[str, Any]:
    data = dict(NotificationSettingSerializer(setting).data)
    return data | ({"webhookSecret": secret} if secret else {})


class NotificationSettingsView(APIView):
    """Your notification settings: email and/or a signed webhook, for the events you choose
    (``ended``, ``failed``, ``timeout``, ``preempted``)."""

    write_scope = Scope.SUBMIT

    def get_throttles(self) -> list[Any]:
        return [ReadThrottle()] if self.request.method == "GET" else [SubmitThrottle()]

    @extend_schema(responses={200: NotificationSettingSerializer, **ERRORS})
    def get(self, request: Request) -> Response:
        return Response(_shown(settings_of(request.user)))

    @extend_schema(
        request=NotificationSettingRequestSerializer, responses={200: SavedSettingSerializer, **ERRORS}
    )
    def put(self, request: Request) -> Response:
        if not isinstance(request.data, dict):
            raise InputError([("(body)", "must be an object")])
        form = NotificationSettingRequestSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        data = form.validated_data
        current = settings_of(request.user)
        try:
            saved = save_settings(
                request.user,
                email=data.get("email", current.email),
                webhook_url=data.get("webhookUrl", current.webhook_url),
                events=data.get("events", current.events),
            )
        except SettingsRefused as exc:
            raise InputError([(exc.field, str(exc))]) from None
        return Response(_shown(saved.setting, saved.new_secret))


class RotateSecretView(APIView):
    """A new webhook secret, replacing the old one at once: shown in this answer only."""

    write_scope = Scope.SUBMIT
    throttle_classes = [SubmitThrottle]

    @extend_schema(
        request=None,
        responses={200: inline_serializer("WebhookSecret", {"webhookSecret": serializers.CharField()})}
        | ERRORS,
    )
    def post(self, request: Request) -> Response:
        try:
            secret = rotate_secret(request.user)
        except SettingsRefused as exc:
            raise InputError([(exc.field, str(exc))]) from None
        return Response({"webhookSecret": secret})


class NotificationTestView(APIView):
    """Queue a test message (a sample job) on every channel you set up."""

    write_scope = Scope.SUBMIT
    throttle_classes = [SubmitThrottle]

    @extend_schema(
        request=None,
        responses={
            202: inline_serializer(
                "NotificationTest", {"channels": serializers.ListField(child=serializers.CharField())}
            ),
            **ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        rows = send_test(request.user)
        if not rows:
            raise InputError([("(body)", "no channel is set up: turn email on or set a webhook URL first")])
        return Response({"channels": [row.channel for row in rows]}, status=status.HTTP_202_ACCEPTED)
