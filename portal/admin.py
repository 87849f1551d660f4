"""Operations console for tenancy: projects with members and queues, API tokens."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest
from django.utils import timezone

from foundation.console import service_action
from portal.choices import Scope
from portal.models import ApiToken, Membership, Project
from portal.selectors import with_member_counts
from portal.services.tokens import (
    DEFAULT_SCOPES,
    TokenRefused,
    check_expiry,
    check_scopes,
    issue_token,
    revoke_token,
)
from scheduling.models import Queue


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ["user"]


class QueueInline(admin.TabularInline):
    model = Queue
    extra = 0
    fields = ["name", "priority", "fair_share_weight", "cohort", "max_pending_jobs"]
    show_change_link = True


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "display_name", "member_count", "created_at"]
    search_fields = ["name", "display_name"]
    inlines = [MembershipInline, QueueInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Project]:
        return with_member_counts(super().get_queryset(request))

    @admin.display(description="Members")
    def member_count(self, obj: Project) -> int:
        return obj.member_count


class ApiTokenAddForm(forms.ModelForm):
    """Issuing a token: the same rules as the API (``portal.services.tokens``), checked here so
    a refusal is shown on its field."""

    scopes = forms.MultipleChoiceField(
        choices=Scope.choices,
        initial=list(DEFAULT_SCOPES),
        widget=forms.CheckboxSelectMultiple,
        help_text="read: every GET; submit: submit and act on jobs, manage tokens; "
        "operate: operators' writes.",
    )
    expires_in_days = forms.IntegerField(
        min_value=1,
        required=False,
        label="Expires in (days)",
        help_text="Empty: this site's maximum (ORRERY_TOKEN_MAX_DAYS).",
    )

    class Meta:
        model = ApiToken
        fields = ["user", "name"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        checks = (
            ("scopes", lambda: check_scopes(data.get("scopes"), None)),
            ("expires_in_days", lambda: check_expiry(data.get("expires_in_days"), None, now=timezone.now())),
        )
        for field, check in checks:
            if field in data:
                try:
                    check()
                except TokenRefused as exc:
                    self.add_error(field, str(exc))
        return data


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Issuing a token here shows its plaintext once, in the confirmation message. A token's
    scopes and expiry are set when it is issued and never changed: revoke it and issue another."""

    list_display = [
        "prefix",
        "name",
        "user",
        "scope_list",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    ]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    list_select_related = ["user"]
    search_fields = ["prefix", "name", "user__username"]
    fields = [
        "user",
        "name",
        "scope_list",
        "expires_at",
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    readonly_fields = ["scope_list", "expires_at", "prefix", "created_at", "last_used_at", "revoked_at"]
    add_fields = ["user", "name", "scopes", "expires_in_days"]
    autocomplete_fields = ["user"]
    actions = [service_action(revoke_token, name="revoke", description="Revoke selected tokens", refusals=())]

    @admin.display(description="Scopes")
    def scope_list(self, obj: ApiToken) -> str:
        return ", ".join(obj.scopes)

    def get_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> list[str]:
        return self.add_fields if obj is None else self.fields

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> list[str]:
        return [] if obj is None else self.readonly_fields

    def get_form(self, request: HttpRequest, obj: ApiToken | None = None, **kwargs: Any) -> type[ModelForm]:
        if obj is None:
            kwargs["form"] = ApiTokenAddForm
        return super().get_form(request, obj, **kwargs)

    def save_model(self, request: HttpRequest, obj: ApiToken, form: ModelForm, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        token, plaintext = issue_token(
            obj.user,
            name=obj.name,
            scopes=form.cleaned_data["scopes"],
            expires_in_days=form.cleaned_data["expires_in_days"],
            actor=request.user,
        )
        obj.pk = token.pk
        self.message_user(
            request,
            f"Token for {obj.user} ({', '.join(token.scopes)}; expires "
            f"{token.expires_at:%Y-%m-%d %H:%M %Z}): {plaintext} — copy it now, it is not shown again.",
            messages.WARNING,
        )
