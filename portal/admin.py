"""Operations console for tenancy: projects with members and queues, API tokens."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest

from foundation.console import service_action
from portal.models import ApiToken, Membership, Project
from portal.selectors import with_member_counts
from portal.services.tokens import issue_token, revoke_token
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


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Issuing a token here shows its plaintext once, in the confirmation message."""

    list_display = ["prefix", "name", "user", "created_at", "last_used_at", "expires_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    list_select_related = ["user"]
    search_fields = ["prefix", "name", "user__username"]
    fields = ["user", "name", "expires_at", "prefix", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "created_at", "last_used_at", "revoked_at"]
    autocomplete_fields = ["user"]
    actions = [service_action(revoke_token, name="revoke", description="Revoke selected tokens", refusals=())]

    def save_model(self, request: HttpRequest, obj: ApiToken, form: ModelForm, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        token, plaintext = issue_token(obj.user, name=obj.name)
        if obj.expires_at:
            ApiToken.objects.filter(pk=token.pk).update(expires_at=obj.expires_at)
        obj.pk = token.pk
        self.message_user(
            request,
            f"Token for {obj.user}: {plaintext} — copy it now, it is not shown again.",
            messages.WARNING,
        )
