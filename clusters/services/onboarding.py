"""Onboarding clusters whose nodes Orrery reads from the cluster's own API (Slurm, Kubernetes):
the connection is tested first, and nothing is created when it fails."""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import urllib3
from django.db import transaction
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from clusters.adapters.base import Inventory
from clusters.adapters.kubernetes.client import KubeError
from clusters.adapters.registry import adapter_for
from clusters.adapters.slurm.accounts import check_output_dir
from clusters.adapters.slurm.api import SlurmClient, SlurmError
from clusters.adapters.slurm.gres import SETTINGS as GRES_SETTINGS
from clusters.adapters.slurm.gres import check_settings
from clusters.adapters.slurm.inventory import collect
from clusters.adapters.tags import new_tag
from clusters.choices import ClusterKind, ClusterState, Identity
from clusters.models import POSIX_NAME, Cluster, ClusterSecret
from foundation import audit
from foundation.choices import AuditAction

log = logging.getLogger(__name__)
POSIX_NAME_RE = re.compile(POSIX_NAME)


@transaction.atomic
def onboard_slurm(
    name: str,
    url: str,
    token: str,
    *,
    user: str = "root",
    slurm_conf: str = "",
    identity: str | None = None,
    output_dir: str = "",
    gres: Mapping[str, Any] | None = None,
    actor: Any = None,
) -> tuple[Cluster, Inventory]:
    """Test the connection, then add (or update) the cluster and read its nodes. Raises
    ``SlurmError`` saying what is wrong (``field`` names the setting at fault); nothing is
    created then. The token is stored apart from the cluster's settings and never shown back.

    ``identity`` (``Identity``) says whose POSIX account users' work runs under: a new cluster
    gets ``accounts`` when none is given. ``output_dir`` is a template for where users' output
    goes (``{home}``, ``{user}``; default ``{home}/.orrery/slurm``). Onboarding an existing
    cluster again (a new token) keeps its identity, its output directory and its job tag unless
    told otherwise: jobs already submitted stay its own. ``gres`` holds the GPU settings
    (``gres.check_settings``: ``gpu_type``, ``mig_gres_types``, ``shards_per_gpu``); those not
    given are kept. ``actor`` is who asked, for the audit
    log (the token is never recorded)."""
    other = Cluster.objects.filter(name=name).exclude(kind=ClusterKind.SLURM).values_list("kind", flat=True)
    if other:
        raise SlurmError(f"a {other[0]} cluster is already named {name!r}", "name")
    if identity is not None and identity not in Identity.values:
        raise SlurmError(
            f"identity must be one of {', '.join(Identity.values)}, not {identity!r}", "identity"
        )
    if output_dir:
        check_output_dir(output_dir)
    gres_settings = check_settings(gres or {})
    client = SlurmClient(url, token, user)
    try:
        version = client.connect()
    except SlurmError as exc:
        if exc.slurmrestd:
            raise  # a slurmrestd answered: what it said helps, and reveals nothing else
        # The same answer whatever else failed (refused, timed out, another service's page): the
        # onboarding form must not be a way to scan the control plane's network. The detail
        # goes to the server's log, where operators debug.
        log.warning("onboarding %s: connection test to %s failed: %s", name, url, exc)
        raise SlurmError(
            "no slurmrestd accepted this token at this URL (the server's log says why)", "url"
        ) from None
    before = (
        Cluster.objects.select_for_update().filter(name=name).values_list("config", flat=True).first() or {}
    )
    output_dir = output_dir or before.get("output_dir") or ""
    config = {
        "url": url,
        "user": user,
        "api": version,
        "tag": before.get("tag") or new_tag(),
        **({"slurm_conf": slurm_conf} if slurm_conf else {}),
        **({"output_dir": output_dir} if output_dir else {}),
        **{key: before[key] for key in GRES_SETTINGS if key in before and key not in (gres or {})},
        **gres_settings,
    }
    defaults = {"kind": ClusterKind.SLURM, "config": config} | ({"identity": identity} if identity else {})
    cluster, created = Cluster.objects.update_or_create(name=name, defaults=defaults)
    ClusterSecret.objects.update_or_create(cluster=cluster, defaults={"data": {"token": token}})
    seen = collect(cluster, client)
    if cluster.state == ClusterState.ONBOARDING:
        Cluster.objects.filter(pk=cluster.pk).update(
            state=ClusterState.READY, state_reason=f"slurmrestd {version}"
        )
    details = {"kind": ClusterKind.SLURM, "url": _shown(url), "user": user, "created": created}
    audit.record(AuditAction.CLUSTER_ONBOARD, actor=actor, target=f"cluster:{name}", details=details)
    return cluster, seen


def _shown(url: str) -> str:
    """The URL as the audit log keeps it: no user or password, no query."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="").geturl()


#: What the Kubernetes adapter does with its credential, checked one by one at onboarding
#: (SelfSubjectAccessReview): (verb, resource, subresource, API group, namespaced).
KUBE_PERMISSIONS: tuple[tuple[str, str, str, str, bool], ...] = (
    *((verb, "nodes", "", "", False) for verb in ("get", "list", "watch")),
    *((verb, "pods", "", "", False) for verb in ("list", "watch")),
    *((verb, "jobs", "", "batch", True) for verb in ("create", "get", "list", "watch", "delete")),
    *((verb, "pods", "", "", True) for verb in ("get", "list", "watch", "delete")),
    ("get", "pods", "log", "", True),
    *((verb, "services", "", "", True) for verb in ("create", "get", "delete")),
    *((verb, "secrets", "", "", True) for verb in ("create", "get", "delete")),
)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@transaction.atomic
def onboard_kubernetes(
    name: str,
    *,
    kubeconfig: str = "",
    url: str = "",
    ca: str = "",
    token: str = "",
    namespace: str = "orrery",
    identity: str | None = None,
    run_as_uid: int | None = None,
    run_as_gid: int | None = None,
    uids: dict[str, int] | None = None,
    actor: Any = None,
) -> tuple[Cluster, Inventory]:
    """Test the connection, then add (or update) a Kubernetes cluster and read its nodes. The
    credential is a whole kubeconfig, or an API server URL with its CA bundle and a bearer
    token; it is sealed apart from the cluster's settings and never shown back.

    Raises ``KubeError`` saying what is wrong, ``field`` naming the setting at fault; nothing is
    created then. Until a real kube-apiserver has answered, every failure reads the same (see
    ``check_kubernetes``). ``namespace`` must exist: Orrery never creates namespaces (that needs
    a cluster-wide right no adapter should hold). ``identity`` defaults to ``shared`` for a new
    cluster (every pod runs as ``run_as_uid``, 1000 unless given); ``accounts`` and ``same_name``
    map each account name to a uid through ``uids``. Onboarding again keeps the job tag, so the
    Jobs already created stay this cluster's."""
    from clusters.adapters.kubernetes.client import Connection, parse_kubeconfig

    other = (
        Cluster.objects.filter(name=name).exclude(kind=ClusterKind.KUBERNETES).values_list("kind", flat=True)
    )
    if other:
        raise KubeError(f"a {other[0]} cluster is already named {name!r}", "name")
    if identity is not None and identity not in Identity.values:
        raise KubeError(f"identity must be one of {', '.join(Identity.values)}, not {identity!r}", "identity")
    if not _DNS_LABEL.fullmatch(namespace or ""):
        raise KubeError(
            "a namespace is a DNS label: lowercase letters, digits and '-', at most 63", "namespace"
        )
    _check_uids(run_as_uid, run_as_gid, uids or {})
    if kubeconfig and (url or token or ca):
        raise KubeError("give a kubeconfig, or a URL, CA and token: not both", "kubeconfig")
    if kubeconfig:
        conn = parse_kubeconfig(kubeconfig)
        secret = {"kubeconfig": kubeconfig}
    else:
        if not url.startswith("https://"):
            raise KubeError("the API server's URL starts with https://", "url")
        if not token:
            raise KubeError("a bearer token is required (or a kubeconfig)", "token")
        if ca and "-----BEGIN CERTIFICATE-----" not in ca:
            raise KubeError("the CA bundle is PEM (-----BEGIN CERTIFICATE-----)", "caCert")
        conn = Connection(url=url, ca=ca, token=token)
        secret = {"token": token, "ca": ca}
    known = Cluster.objects.filter(name=name).values_list("config", flat=True).first() or {}
    if known.get("namespace", namespace) != namespace:
        raise KubeError(
            f"the cluster already runs its work in namespace {known['namespace']!r}; a new namespace "
            "would strand it — add the cluster again under another name instead",
            "namespace",
        )
    version, user = check_kubernetes(conn, namespace, credential="kubeconfig" if kubeconfig else "token")
    before = (
        Cluster.objects.select_for_update().filter(name=name).values_list("config", flat=True).first() or {}
    )
    # Onboarding again (a rotated credential) keeps what the operator set before unless told
    # otherwise: tolerated taints, the uids of accounts, the shared uid, the tag.
    config = {
        **before,
        "url": conn.url,
        "namespace": namespace,
        "api": version,
        "tag": before.get("tag") or new_tag(),
        **({"run_as_uid": run_as_uid} if run_as_uid else {}),
        **({"run_as_gid": run_as_gid} if run_as_gid else {}),
        **({"uids": dict(uids)} if uids else {}),
    }
    created_identity = identity or (None if before else Identity.SHARED)
    defaults = {"kind": ClusterKind.KUBERNETES, "config": config} | (
        {"identity": created_identity} if created_identity else {}
    )
    cluster, created = Cluster.objects.update_or_create(name=name, defaults=defaults)
    ClusterSecret.objects.update_or_create(cluster=cluster, defaults={"data": secret})
    seen = adapter_for(ClusterKind.KUBERNETES).inventory(cluster)
    if cluster.state == ClusterState.ONBOARDING:
        Cluster.objects.filter(pk=cluster.pk).update(
            state=ClusterState.READY, state_reason=f"Kubernetes {version}, as {user}"[:255]
        )
    details = {
        "kind": ClusterKind.KUBERNETES,
        "url": _shown(conn.url),
        "namespace": namespace,
        "user": user,
        "created": created,
    }
    audit.record(AuditAction.CLUSTER_ONBOARD, actor=actor, target=f"cluster:{name}", details=details)
    return cluster, seen


def check_kubernetes(conn: Any, namespace: str, *, credential: str = "token") -> tuple[str, str]:
    """The connection test: returns the server's version and who the credential is.

    Until a kube-apiserver has answered, every failure reads the same (refused, timed out,
    another service, a TLS handshake with something that is not a kube-apiserver): the
    onboarding form must not be a way to scan the control plane's network. Once one answered,
    the error is precise: its certificate is not signed by the given CA (checked by a second
    call that sends no credential and is only believed when a kube-apiserver answers it), 401,
    each missing permission by verb and resource, the namespace missing or terminating."""
    from clusters.adapters.kubernetes.client import TIMEOUT, build_client

    api = build_client(conn)
    try:
        version = _version(api)
    except ApiException as exc:
        if exc.status == 0:  # the client's word for a TLS failure
            raise _transport(conn, exc, credential) from None
        if not _is_status(exc.body):
            raise _unreachable(conn.url, exc) from None
        if exc.status == 401:
            raise KubeError(
                "the API server did not accept this credential (401 Unauthorized)", credential, apiserver=True
            ) from None
        raise KubeError(
            f"the API server answered {exc.status} to GET /version", credential, apiserver=True
        ) from None
    except urllib3.exceptions.HTTPError as exc:
        raise _transport(conn, exc, credential) from None
    except ValueError as exc:
        raise _unreachable(conn.url, exc) from None
    user = _whoami(api)
    missing = []
    auth = k8s.AuthorizationV1Api(api)
    for verb, resource, sub, group, namespaced in KUBE_PERMISSIONS:
        attributes = {"verb": verb, "resource": resource, "group": group}
        if sub:
            attributes["subresource"] = sub
        if namespaced:
            attributes["namespace"] = namespace
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        try:
            answer = auth.create_self_subject_access_review(
                body, _preload_content=False, _request_timeout=TIMEOUT
            )
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise KubeError(
                f"could not check permissions: {_said(exc)}", credential, apiserver=True
            ) from None
        if not (json.loads(answer.data).get("status") or {}).get("allowed"):
            what = f"{resource}/{sub}" if sub else resource
            where = f'in namespace "{namespace}"' if namespaced else "at the cluster scope"
            missing.append(f"{verb} {what}{'.' + group if group else ''} {where}")
    if missing:
        raise KubeError(
            f"{user or 'the credential'} may not: "
            + "; ".join(missing)
            + " (the RBAC Orrery needs is in docs/clusters/kubernetes.md)",
            credential,
            apiserver=True,
        )
    try:
        ns = json.loads(
            k8s.CoreV1Api(api)
            .read_namespace(namespace, _preload_content=False, _request_timeout=TIMEOUT)
            .data
        )
    except ApiException as exc:
        if exc.status == 404:
            raise KubeError(
                f"namespace {namespace!r} does not exist: create it (kubectl create namespace "
                f"{namespace}) with the Role and RoleBinding of docs/clusters/kubernetes.md",
                "namespace",
                apiserver=True,
            ) from None
        ns = {}  # 403: the credential may not read namespaces; its Role there says it exists
    except urllib3.exceptions.HTTPError as exc:
        raise KubeError(f"could not read the namespace: {_said(exc)}", "namespace", apiserver=True) from None
    if (ns.get("status") or {}).get("phase") == "Terminating":
        raise KubeError(f"namespace {namespace!r} is being deleted", "namespace", apiserver=True)
    return version, user


def _version(api: Any) -> str:
    from clusters.adapters.kubernetes.client import TIMEOUT

    response = k8s.VersionApi(api).get_code(_preload_content=False, _request_timeout=TIMEOUT)
    answer = json.loads(response.data)
    if not isinstance(answer, dict) or not str(answer.get("gitVersion") or "").startswith("v"):
        raise ValueError("not a Kubernetes /version answer")
    return str(answer["gitVersion"])


def _whoami(api: Any) -> str:
    from clusters.adapters.kubernetes.client import TIMEOUT

    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    try:
        answer = k8s.AuthenticationV1Api(api).create_self_subject_review(
            body, _preload_content=False, _request_timeout=TIMEOUT
        )
        return str(
            ((json.loads(answer.data).get("status") or {}).get("userInfo") or {}).get("username") or ""
        )
    except (ApiException, urllib3.exceptions.HTTPError, ValueError):
        return ""


def _kube_answers(conn: Any) -> bool:
    """Whether a kube-apiserver is what speaks TLS there: asked without checking its
    certificate and without sending any credential (so nothing is given to an impostor)."""
    from clusters.adapters.kubernetes.client import build_client

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            _version(build_client(conn, verify=False, credentials=False))
        return True
    except ApiException as exc:
        return exc.status in (401, 403) and _is_status(exc.body)
    except Exception:
        return False


def _transport(conn: Any, exc: BaseException, credential: str) -> KubeError:
    """A failure below HTTP: precise only for a TLS failure where a kube-apiserver is what
    answers (``_kube_answers``), the uniform answer otherwise."""
    if _tls_failure(exc) and _kube_answers(conn):
        return KubeError(
            "a Kubernetes API server answered, but its certificate is not signed by the given CA",
            "kubeconfig" if credential == "kubeconfig" else "caCert",
            apiserver=True,
        )
    return _unreachable(conn.url, exc)


def _tls_failure(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):  # the official client turns urllib3's SSLError into status 0
        return exc.status == 0 and str(exc.reason or "").startswith("SSLError")
    reason = getattr(exc, "reason", None)
    return isinstance(exc, urllib3.exceptions.SSLError) or isinstance(reason, urllib3.exceptions.SSLError)


def _is_status(body: object) -> bool:
    try:
        parsed = json.loads(body) if isinstance(body, str | bytes) else None
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("kind") == "Status" and "code" in parsed


def _said(exc: BaseException) -> str:
    from clusters.adapters.kubernetes.adapter import describe

    return describe(exc)


def _unreachable(url: str, exc: BaseException) -> KubeError:
    log.warning("onboarding: connection test to %s failed: %s", _shown(url), exc)
    return KubeError(
        "no Kubernetes API server accepted this credential at this URL (the server's log says why)", "url"
    )


def _check_uids(uid: int | None, gid: int | None, uids: dict[str, int]) -> None:
    for field, value in (("runAsUser", uid), ("runAsGroup", gid)):
        if value is not None and not (0 < int(value) < 2**31):
            raise KubeError("a uid or gid between 1 and 2147483647 (never root)", field)
    for account, value in uids.items():
        if not POSIX_NAME_RE.fullmatch(str(account)) or account == "root":
            raise KubeError(f"not a POSIX account name: {str(account)[:40]!r}", "uids")
        if not isinstance(value, int) or isinstance(value, bool) or not (0 < value < 2**31):
            raise KubeError(f"the uid of {account!r} must be between 1 and 2147483647 (never root)", "uids")
