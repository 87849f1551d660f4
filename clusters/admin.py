"""Operations console for the resource model. Actions call the same services as the API."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from clusters.adapters.kubernetes.client import KubeError
from clusters.adapters.slurm.accounts import check_output_dir
from clusters.adapters.slurm.api import SlurmError
from clusters.adapters.slurm.inventory import client_for
from clusters.choices import Identity
from clusters.models import (
    Cluster,
    ClusterCredential,
    GpuDevice,
    GpuModel,
    GpuModelAlias,
    JoinToken,
    MetricPoint,
    MigInstance,
    Node,
    NodeCredential,
    NodeEvent,
    NodeLastSeen,
    PosixAccount,
)
from clusters.services.credentials import (
    allow_reregistration,
    create_join_token,
    issue_cluster_credential,
    revoke,
)
from clusters.services.identity import map_account, unmap_account
from clusters.services.mig import check_mig_layout
from clusters.services.nodes import NodeActionRefused, cordon_node, drain_node, resume_node
from clusters.services.onboarding import onboard_kubernetes, onboard_slurm
from clusters.services.power import (
    GPU_IDLE_SHARE,
    PowerActionRefused,
    PowerResult,
    power_down_nodes,
    power_plan,
    power_up_nodes,
    waiting_models,
)
from foundation.console import ReadOnlyAdminMixin, ReadOnlyInline, service_action
from foundation.units import MISSING, memory_text, power_text

_REFUSALS = (NodeActionRefused,)


class GpuModelAliasInline(admin.TabularInline):
    model = GpuModelAlias
    extra = 1


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "vendor", "memory_mb", "tdp_watts", "relative_throughput", "device_count"]
    list_filter = ["vendor"]
    search_fields = ["slug", "name", "aliases__name"]
    inlines = [GpuModelAliasInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[GpuModel]:
        return super().get_queryset(request).annotate(_devices=Count("devices"))

    @admin.display(description="GPUs in fleet", ordering="_devices")
    def device_count(self, obj: GpuModel) -> int:
        return obj._devices


class SlurmOnboardForm(forms.Form):
    name = forms.SlugField(max_length=64)
    url = forms.URLField(
        label="slurmrestd URL", assume_scheme="http", help_text="e.g. http://slurm-head:6820"
    )
    token = forms.CharField(
        label="JWT", widget=forms.PasswordInput, help_text="scontrol token username=USER lifespan=…"
    )
    user = forms.CharField(initial="root", help_text="The Slurm user Orrery submits as.")
    slurm_conf = forms.CharField(
        required=False, label="slurm.conf", help_text="For the sbatch client on the Orrery host."
    )
    identity = forms.ChoiceField(
        choices=Identity.choices,
        initial=Identity.ACCOUNTS,
        required=False,
        help_text="Whose POSIX account users' work runs under on this cluster (a cluster added "
        "again keeps its own unless told otherwise).",
    )
    output_dir = forms.CharField(
        required=False,
        label="Output directory",
        help_text="Where users' output goes, with {home} and {user}; default {home}/.orrery/slurm.",
    )

    def clean_output_dir(self) -> str:
        value = self.cleaned_data["output_dir"]
        try:
            return check_output_dir(value) if value else value
        except SlurmError as exc:
            raise forms.ValidationError(str(exc)) from None


class KubernetesOnboardForm(forms.Form):
    name = forms.SlugField(max_length=64)
    kubeconfig = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 8, "autocomplete": "off"}),
        help_text="A whole kubeconfig with its credentials inline (no exec plugins, no file paths); "
        "or leave empty and give the URL, CA and token below.",
    )
    url = forms.URLField(
        required=False, label="API server URL", assume_scheme="https", help_text="e.g. https://k8s-api:6443"
    )
    ca_cert = forms.CharField(
        required=False, label="CA bundle (PEM)", widget=forms.Textarea(attrs={"rows": 4})
    )
    token = forms.CharField(required=False, label="Bearer token", widget=forms.PasswordInput)
    namespace = forms.CharField(
        initial="orrery", max_length=63, help_text="The namespace Orrery owns; it must exist."
    )
    identity = forms.ChoiceField(
        choices=Identity.choices,
        initial=Identity.SHARED,
        required=False,
        help_text="Shared: every pod runs as the uid below. Mapped accounts need a uid per account.",
    )
    run_as_user = forms.IntegerField(required=False, min_value=1, label="Run pods as uid", initial=1000)
    run_as_group = forms.IntegerField(required=False, min_value=1, label="Run pods as gid")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if not data.get("kubeconfig") and not (data.get("url") and data.get("token")):
            raise forms.ValidationError("Give a kubeconfig, or the API server URL, its CA and a token.")
        return data


class PowerActionForm(forms.Form):
    """A power action of the console's power page: which, on which cluster (the nodes are a
    list of ids, checked apart)."""

    action = forms.ChoiceField(choices=[("down", "Power down"), ("up", "Power up")])
    cluster = forms.ModelChoiceField(queryset=Cluster.objects.all())


MAX_NODES_PER_ACTION = 10_000


def node_ids(values: list[str]) -> list[int] | None:
    """The posted node ids, or None when any is not a plain id (or there are absurdly many)."""
    if len(values) > MAX_NODES_PER_ACTION or not all(
        v.isascii() and v.isdigit() and len(v) <= 18 for v in values
    ):
        return None
    return [int(v) for v in values]


class PosixAccountInline(admin.TabularInline):
    """Which POSIX account each user's work runs under here (identity "mapped accounts")."""

    model = PosixAccount
    extra = 1
    fields = ["user", "username", "created_at"]
    readonly_fields = ["created_at"]
    autocomplete_fields = ["user"]
    verbose_name = "POSIX account"


@admin.register(PosixAccount)
class PosixAccountAdmin(admin.ModelAdmin):
    """Mappings change through ``map_account``/``unmap_account``, as in the API: audited."""

    list_display = ["user", "cluster", "username", "created_at"]
    list_filter = ["cluster"]
    search_fields = ["user__username", "username"]
    autocomplete_fields = ["user"]

    def save_model(
        self, request: HttpRequest, obj: PosixAccount, form: forms.ModelForm, change: bool
    ) -> None:
        obj.pk = save_accounts([obj], [], actor=request.user)[0].pk

    def delete_model(self, request: HttpRequest, obj: PosixAccount) -> None:
        save_accounts([], [obj], actor=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[PosixAccount]) -> None:
        save_accounts([], list(queryset.select_related("cluster", "user")), actor=request.user)


@transaction.atomic
def save_accounts(
    saved: list[PosixAccount], deleted: list[PosixAccount], *, actor: Any
) -> list[PosixAccount]:
    """Write the console's edits of account mappings through the services. A row whose cluster
    or user was changed is first unmapped under its old key (still in the database: the form
    has not saved it)."""
    # The keys as stored: a deleted form's instance carries whatever else was typed in its row.
    for account in PosixAccount.objects.select_related("cluster", "user").filter(
        pk__in=[a.pk for a in deleted]
    ):
        unmap_account(account.cluster, account.user, actor=actor)
    out = []
    for account in saved:
        if account.pk is not None:
            before = PosixAccount.objects.select_related("cluster", "user").get(pk=account.pk)
            if (before.cluster_id, before.user_id) != (account.cluster_id, account.user_id):
                unmap_account(before.cluster, before.user, actor=actor)
        out.append(map_account(account.cluster, account.user, account.username, actor=actor)[0])
    return out


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "display_name",
        "kind",
        "identity",
        "state",
        "state_reason",
        "node_count",
        "created_at",
    ]
    list_filter = ["kind", "state", "identity"]
    inlines = [PosixAccountInline]
    search_fields = ["name", "display_name"]
    readonly_fields = ["state_changed_at", "created_at"]
    exclude = ["config"]  # connection settings change through onboarding; secrets are never shown
    actions = ["new_join_token", "new_collector_credential", "test_connection"]

    def get_urls(self) -> list[URLPattern]:
        onboard = path(
            "onboard-slurm/",
            self.admin_site.admin_view(self.onboard_slurm_view),
            name="clusters_cluster_onboard_slurm",
        )
        onboard_kubernetes = path(
            "onboard-kubernetes/",
            self.admin_site.admin_view(self.onboard_kubernetes_view),
            name="clusters_cluster_onboard_kubernetes",
        )
        power = path("power/", self.admin_site.admin_view(self.power_view), name="clusters_cluster_power")
        return [onboard, onboard_kubernetes, power, *super().get_urls()]

    def power_view(self, request: HttpRequest) -> HttpResponse:
        """Power-saving recommendations per cluster (anyone who may view nodes) and the power
        actions (those who may change nodes; POST only, CSRF-checked by the admin)."""
        if not request.user.has_perm("clusters.view_node"):
            raise PermissionDenied
        if request.method == "POST":
            return self._power_action(request)
        context = self.admin_site.each_context(request) | {
            "title": "Power saving",
            "plans": power_plan(),
            "waiting": waiting_models(),
            "may_act": request.user.has_perm("clusters.change_node"),
            "idle_s": settings.ORRERY_POWER_IDLE_S,
            "keep_idle": settings.ORRERY_POWER_KEEP_IDLE,
            "fresh_s": settings.ORRERY_TELEMETRY_STALE_S,
            "base_w": settings.ORRERY_POWER_NODE_BASE_W,
            "gpu_share": round(GPU_IDLE_SHARE * 100),
        }
        return TemplateResponse(request, "admin/clusters/cluster/power.html", context)

    def _power_action(self, request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm("clusters.change_node"):
            raise PermissionDenied
        form = PowerActionForm(request.POST)
        ids = node_ids(request.POST.getlist("node"))
        if not form.is_valid() or ids is None:
            return HttpResponseBadRequest(
                "Give an action, a cluster and node ids.", content_type="text/plain"
            )
        cluster, action = form.cleaned_data["cluster"], form.cleaned_data["action"]
        act = power_down_nodes if action == "down" else power_up_nodes
        try:
            result: PowerResult = act(cluster, ids, actor=request.user)
        except PowerActionRefused as exc:
            self.message_user(request, str(exc), messages.ERROR)
        else:
            verb = "Powered down" if action == "down" else "Powered up"
            if result.done:
                self.message_user(
                    request, f"{verb} on {cluster}: {', '.join(result.done)}.", messages.SUCCESS
                )
            for why in result.refused:
                self.message_user(request, why, messages.WARNING)
        return HttpResponseRedirect(reverse("admin:clusters_cluster_power"))

    def has_onboard_permission(self, request: HttpRequest) -> bool:
        """Onboarding and machine credentials need their own permission, not the staff flag."""
        return request.user.has_perm("clusters.onboard_cluster")

    def onboard_slurm_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_onboard_permission(request):
            return HttpResponseRedirect(reverse("admin:clusters_cluster_changelist"))
        form = SlurmOnboardForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            try:
                cluster, collected = onboard_slurm(
                    data["name"],
                    data["url"],
                    data["token"],
                    user=data["user"],
                    slurm_conf=data["slurm_conf"],
                    identity=data["identity"] or None,
                    output_dir=data["output_dir"],
                    actor=request.user,
                )
            except SlurmError as exc:
                form.add_error(
                    exc.field if exc.field in form.fields else None, f"Connection test failed: {exc}"
                )
            else:
                return self._onboarded(request, cluster, collected, "slurmrestd")
        intro = (
            "Orrery tests the connection to slurmrestd before it adds anything, and says what is wrong. "
            "The token is stored apart from the cluster's settings and never shown again."
        )
        return self._onboard_page(request, form, "Add a Slurm cluster", intro)

    def onboard_kubernetes_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_onboard_permission(request):
            return HttpResponseRedirect(reverse("admin:clusters_cluster_changelist"))
        form = KubernetesOnboardForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            try:
                cluster, collected = onboard_kubernetes(
                    data["name"],
                    kubeconfig=data["kubeconfig"],
                    url=data["url"] if not data["kubeconfig"] else "",
                    ca=data["ca_cert"] if not data["kubeconfig"] else "",
                    token=data["token"] if not data["kubeconfig"] else "",
                    namespace=data["namespace"],
                    identity=data["identity"] or None,
                    run_as_uid=data["run_as_user"],
                    run_as_gid=data["run_as_group"],
                    actor=request.user,
                )
            except KubeError as exc:
                field = {"caCert": "ca_cert", "runAsUser": "run_as_user", "runAsGroup": "run_as_group"}.get(
                    exc.field, exc.field
                )
                prefix = "Connection test failed: " if exc.apiserver or exc.field == "url" else ""
                form.add_error(field if field in form.fields else None, f"{prefix}{exc}")
            else:
                return self._onboarded(request, cluster, collected, "Kubernetes")
        intro = (
            "Orrery tests the connection to the API server before it adds anything — the certificate, "
            "the credential, each permission it needs and the namespace — and says what is wrong. The "
            "kubeconfig or token is sealed apart from the cluster's settings and never shown again. The "
            "minimal RBAC is in docs/clusters/kubernetes.md."
        )
        return self._onboard_page(request, form, "Add a Kubernetes cluster", intro)

    def _onboarded(self, request: HttpRequest, cluster: Cluster, collected: Any, server: str) -> HttpResponse:
        note = f"Cluster {cluster.name}: {server} {cluster.config['api']}, "
        note += f"{collected.nodes} nodes, {collected.gpus} GPUs."
        if collected.unknown_gpu_types:
            note += " GPU types not in the catalog: " + ", ".join(collected.unknown_gpu_types)
        self.message_user(request, note, messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:clusters_cluster_change", args=[cluster.pk]))

    def _onboard_page(self, request: HttpRequest, form: Any, title: str, intro: str) -> HttpResponse:
        context = self.admin_site.each_context(request) | {"form": form, "title": title, "intro": intro}
        return TemplateResponse(request, "admin/clusters/cluster/onboard.html", context)

    @admin.action(description="Test the connection (Slurm)")
    def test_connection(self, request: HttpRequest, queryset: QuerySet[Cluster]) -> None:
        for cluster in queryset.filter(kind="slurm"):
            try:
                version = client_for(cluster).connect()
            except SlurmError as exc:
                self.message_user(request, f"{cluster}: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"{cluster}: slurmrestd answers ({version}).", messages.SUCCESS)

    @admin.action(description="Create a join token (for orrery-agent)", permissions=["onboard"])
    def new_join_token(self, request: HttpRequest, queryset: QuerySet[Cluster]) -> None:
        for cluster in queryset:
            token, plaintext = create_join_token(cluster, name=f"by {request.user}", actor=request.user)
            self.message_user(
                request,
                f"Join token for {cluster}: {plaintext} — shown once; admits one machine until "
                f"{token.expires_at:%H:%M %Z} (manage.py create_join_token sets other limits).",
                messages.WARNING,
            )

    @admin.action(description="Create a collector credential", permissions=["onboard"])
    def new_collector_credential(self, request: HttpRequest, queryset: QuerySet[Cluster]) -> None:
        for cluster in queryset:
            _, plaintext = issue_cluster_credential(cluster, name=f"by {request.user}", actor=request.user)
            self.message_user(
                request, f"Collector credential for {cluster}: {plaintext} — shown once.", messages.WARNING
            )

    def save_formset(self, request: HttpRequest, form: forms.ModelForm, formset: Any, change: bool) -> None:
        if formset.model is not PosixAccount:
            return super().save_formset(request, form, formset, change)
        saved = formset.save(commit=False)  # validated, not written: the services write
        save_accounts(saved, formset.deleted_objects, actor=request.user)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Cluster]:
        return super().get_queryset(request).annotate(_nodes=Count("nodes"))

    @admin.display(description="Nodes", ordering="_nodes")
    def node_count(self, obj: Cluster) -> int:
        return obj._nodes


class GpuReadings:
    """A GPU's size and readings with their units, for the GPU pages and the node page."""

    @admin.display(description="Memory", ordering="memory_mb")
    def memory(self, obj: GpuDevice) -> str:
        return memory_text(obj.memory_mb * 2**20)

    @admin.display(description="Util.", ordering="utilization")
    def utilisation(self, obj: GpuDevice) -> str:
        return MISSING if obj.utilization is None else f"{obj.utilization:.0f} %"

    @admin.display(description="Memory used", ordering="memory_used_mb")
    def memory_used(self, obj: GpuDevice) -> str:
        return MISSING if obj.memory_used_mb is None else memory_text(obj.memory_used_mb * 2**20)

    @admin.display(description="Power", ordering="power_w")
    def power(self, obj: GpuDevice) -> str:
        return power_text(obj.power_w)

    @admin.display(description="Temp.", ordering="temperature_c")
    def temperature(self, obj: GpuDevice) -> str:
        return MISSING if obj.temperature_c is None else f"{obj.temperature_c:.0f} °C"

    @admin.display(description="MIG layout")
    def mig_layout(self, obj: GpuDevice) -> str:
        """The instances the GPU reports, as ``3g.40gb, 2g.20gb ×2``."""
        if not obj.mig_enabled:
            return MISSING
        counts: dict[str, int] = {}
        for instance in obj.mig_instances.all():
            counts[instance.profile] = counts.get(instance.profile, 0) + 1
        return ", ".join(f"{p} ×{n}" if n > 1 else p for p, n in counts.items()) or "no instances"


class GpuForm(forms.ModelForm):
    """What an operator sets on a GPU, checked: a MIG layout must be one a GPU can hold."""

    class Meta:
        model = GpuDevice
        fields = ["health", "health_reason", "shareable", "mig_layout_wanted"]

    def clean_mig_layout_wanted(self) -> list[str] | None:
        return check_mig_layout(self.cleaned_data.get("mig_layout_wanted"))


# What a GPU reports is read-only: the next heartbeat would overwrite an edit. Its health is the
# operator's to set (and say why).
GPU_FIELDS = [
    "index",
    "model",
    "uuid",
    "memory",
    "health",
    "health_reason",
    "utilisation",
    "memory_used",
    "power",
    "temperature",
    "topology_group",
    "shareable",
    "mig_enabled",
    "mig_layout",
    "mig_layout_wanted",
]
# The operator's: health (and why), whether the GPU is offered in fractions, the MIG layout wanted.
GPU_REPORTED = [
    f for f in GPU_FIELDS if f not in ("health", "health_reason", "shareable", "mig_layout_wanted")
]


class GpuDeviceInline(GpuReadings, admin.TabularInline):
    """A node's GPUs as its agent (or its cluster) reports them."""

    model = GpuDevice
    form = GpuForm
    extra = 0
    fields = GPU_FIELDS
    readonly_fields = GPU_REPORTED

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # GPUs come from heartbeats

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class NodeEventInline(ReadOnlyInline):
    model = NodeEvent
    fields = ["at", "from_state", "to_state", "reason", "actor"]
    readonly_fields = fields
    ordering = ["-id"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "cluster",
        "state",
        "gpu_capacity",
        "cpu_cores",
        "memory_total",
        "last_heartbeat_at",
        "agent_version",
        "power_state",
    ]
    list_filter = ["state", "cluster", "power_state", "gpus__model"]
    list_select_related = ["cluster"]
    search_fields = ["name", "cluster__name", "rack"]
    # What the node reports (capacity, load, versions) is shown with its units and never edited
    # here: the next heartbeat would overwrite it. Operators edit where it sits and its labels.
    fieldsets = [
        (None, {"fields": ["cluster", "name", "state", "state_reason", "state_changed_at", "power_state"]}),
        ("Capacity (reported by the node)", {"fields": ["gpus_shown", "cpus_shown", "memory_shown"]}),
        ("Placement", {"fields": ["labels", "rack", "switch", "nvlink_domain"]}),
        (
            "Last report",
            {
                "fields": [
                    "last_heartbeat_at",
                    "heartbeats",
                    "agent_version",
                    "boot_id",
                    "cpu_load_shown",
                    "memory_used_shown",
                    "power_shown",
                ]
            },
        ),
    ]
    # everything shown except what operators edit (where the node sits and its labels); the power
    # state changes through the power page's actions, which switch the machine too
    readonly_fields = [
        name
        for _, options in fieldsets
        for name in options["fields"]
        if name not in ("cluster", "name", "labels", "rack", "switch", "nvlink_domain")
    ]
    inlines = [GpuDeviceInline, NodeEventInline]
    actions = [
        service_action(drain_node, name="drain", description="Drain selected nodes", refusals=_REFUSALS),
        service_action(cordon_node, name="cordon", description="Cordon selected nodes", refusals=_REFUSALS),
        service_action(resume_node, name="resume", description="Resume selected nodes", refusals=_REFUSALS),
        service_action(
            allow_reregistration,
            name="replace",
            description="Replace node: revoke its credential so it can register again",
            refusals=(),
        ),
    ]

    @admin.display(description="Heartbeats")
    def heartbeats(self, obj: Node) -> str:
        seen = NodeLastSeen.objects.filter(node=obj).first()
        if seen is None:
            return "none received"
        return (
            f"last at {seen.seen_at:%Y-%m-%d %H:%M:%S}, on time since {seen.good_since:%Y-%m-%d %H:%M:%S}, "
            f"sequence {seen.seq}, boot {seen.boot_id[:12] or '—'}"
        )

    @admin.display(description="GPUs")
    def gpus_shown(self, obj: Node) -> int:
        return obj.gpu_capacity

    @admin.display(description="CPUs")
    def cpus_shown(self, obj: Node) -> str:
        total, allocatable = obj.cpu_millicores_capacity / 1000, obj.cpu_millicores_allocatable / 1000
        return f"{total:g} cores ({allocatable:g} allocatable)"

    @admin.display(description="Memory")
    def memory_shown(self, obj: Node) -> str:
        total, allocatable = obj.memory_bytes_capacity, obj.memory_bytes_allocatable
        return f"{memory_text(total)} ({memory_text(allocatable)} allocatable)"

    @admin.display(description="CPU load")
    def cpu_load_shown(self, obj: Node) -> str:
        return MISSING if obj.cpu_load is None else f"{100 * obj.cpu_load:.0f} %"

    @admin.display(description="Memory used")
    def memory_used_shown(self, obj: Node) -> str:
        return memory_text(obj.memory_used_bytes)

    @admin.display(description="Power")
    def power_shown(self, obj: Node) -> str:
        return power_text(obj.power_w)

    @admin.display(description="CPU cores", ordering="cpu_millicores_capacity")
    def cpu_cores(self, obj: Node) -> float:
        return obj.cpu_millicores_capacity / 1000

    @admin.display(description="Memory", ordering="memory_bytes_capacity")
    def memory_total(self, obj: Node) -> str:
        return memory_text(obj.memory_bytes_capacity)


class MigInstanceInline(ReadOnlyInline):
    """A GPU's MIG instances as its node reports them."""

    model = MigInstance
    fields = ["slot", "profile", "uuid", "memory_mb", "slices"]
    readonly_fields = fields


@admin.register(GpuDevice)
class GpuDeviceAdmin(GpuReadings, admin.ModelAdmin):
    list_display = [
        "__str__",
        "model",
        "health",
        "shareable",
        "mig_enabled",
        "utilisation",
        "memory_used",
        "power",
        "temperature",
    ]
    form = GpuForm
    fields = ["node", *GPU_FIELDS]
    readonly_fields = ["node", *GPU_REPORTED]
    inlines = [MigInstanceInline]
    list_filter = ["model", "health", "shareable", "mig_enabled", "node__cluster"]
    list_select_related = ["node__cluster", "model"]
    search_fields = ["uuid", "node__name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # GPUs come from heartbeats


@admin.register(NodeEvent)
class NodeEventAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["at", "node", "from_state", "to_state", "reason", "actor"]
    list_filter = ["to_state", "node__cluster"]
    list_select_related = ["node__cluster", "actor"]
    search_fields = ["node__name", "reason"]


class _CredentialAdmin(admin.ModelAdmin):
    """Credentials are created by actions and commands (the plaintext is shown once); here
    they are listed and revoked."""

    readonly_fields = ["prefix", "created_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    actions = [service_action(revoke, name="revoke", description="Revoke selected", refusals=())]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(JoinToken)
class JoinTokenAdmin(_CredentialAdmin):
    list_display = ["prefix", "cluster", "name", "uses", "created_at", "expires_at", "revoked_at"]
    list_select_related = ["cluster"]
    readonly_fields = [*_CredentialAdmin.readonly_fields, "uses"]


@admin.register(NodeCredential)
class NodeCredentialAdmin(_CredentialAdmin):
    list_display = ["prefix", "node", "created_at", "revoked_at"]
    list_select_related = ["node__cluster"]
    search_fields = ["node__name"]


@admin.register(ClusterCredential)
class ClusterCredentialAdmin(_CredentialAdmin):
    list_display = ["prefix", "cluster", "name", "created_at", "revoked_at"]
    list_select_related = ["cluster"]


@admin.register(MetricPoint)
class MetricPointAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "at",
        "resolution",
        "cluster",
        "gpu_model",
        "gpus_total",
        "gpus_allocated",
        "utilization",
        "power_w",
    ]
    list_filter = ["resolution", "cluster", "gpu_model"]
    list_select_related = ["cluster", "gpu_model"]
    date_hierarchy = "at"
