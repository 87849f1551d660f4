"""The API client of one Kubernetes cluster, built from what onboarding stored and nothing else.

A cluster's connection lives in two places: ``Cluster.config`` (the API server URL and the
namespace Orrery owns there) and its ``ClusterSecret`` (sealed at rest): either a whole
kubeconfig, or a bearer token and the CA bundle that signs the API server's certificate. The
control plane's own environment (``KUBECONFIG``, ``~/.kube``, in-cluster service account files,
``HTTPS_PROXY``) is never read: an Orrery host that happens to run inside some cluster must not
act on it with its own rights.

A kubeconfig may only carry its credentials inline. ``exec`` and ``auth-provider`` plugins
(which would run a program on the control plane), file references (which would read the
control plane's files) and ``insecure-skip-tls-verify`` are refused when the kubeconfig is
read (``parse_kubeconfig``), so a kubeconfig given through the API cannot run or read
anything on the server.

``api_for(cluster)`` keeps one ``ApiClient`` per cluster per process, rebuilt when the sealed
secret or the URL changes (a re-onboarding with a new token takes effect at the next call).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import yaml
from kubernetes import client as k8s

from clusters.models import Cluster, ClusterSecret

#: (connect, read) seconds for every request but watches; a watch sets its own read timeout.
TIMEOUT = (5.0, 30.0)
_PLUGINS = ("exec", "auth-provider")
_FILE_KEYS = ("certificate-authority", "client-certificate", "client-key", "tokenFile", "token-file")


class KubeError(Exception):
    """A Kubernetes cluster could not be used: ``field`` names the setting at fault (for
    onboarding's 400), ``apiserver`` says a real API server answered (so the detail may be
    shown: it reveals nothing about the control plane's network)."""

    def __init__(self, message: str, field: str = "", *, apiserver: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.apiserver = apiserver


@dataclass(frozen=True)
class Connection:
    """What an ``ApiClient`` is built from: the API server, how it is trusted, who we are."""

    url: str
    ca: str = ""  # PEM
    token: str = ""
    client_cert: str = ""  # PEM, with client_key: a kubeconfig's client certificate
    client_key: str = ""
    tls_server_name: str = ""

    def fingerprint(self) -> str:
        text = "\0".join(
            (self.url, self.ca, self.token, self.client_cert, self.client_key, self.tls_server_name)
        )
        return hashlib.sha256(text.encode()).hexdigest()


def parse_kubeconfig(text: str) -> Connection:
    """The connection of a kubeconfig's current context (pure). Raises ``KubeError`` (field
    ``kubeconfig``) for what Orrery will not use: plugins, file references, TLS checks off."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KubeError(f"not YAML: {str(exc).splitlines()[0][:200]}", "kubeconfig") from None
    if not isinstance(doc, dict):
        raise KubeError("a kubeconfig is a mapping (apiVersion: v1, kind: Config)", "kubeconfig")
    name = doc.get("current-context") or ""
    contexts = {c.get("name"): c.get("context") or {} for c in _items(doc, "contexts")}
    if not name and len(contexts) == 1:
        name = next(iter(contexts))
    if name not in contexts:
        raise KubeError(f"no context {name!r} in the kubeconfig (set current-context)", "kubeconfig")
    context = contexts[name]
    clusters = {c.get("name"): c.get("cluster") or {} for c in _items(doc, "clusters")}
    users = {u.get("name"): u.get("user") or {} for u in _items(doc, "users")}
    cluster = clusters.get(context.get("cluster"))
    if cluster is None:
        raise KubeError(f"context {name!r} names no cluster of the kubeconfig", "kubeconfig")
    user = users.get(context.get("user"), {})
    for key in _PLUGINS:
        if user.get(key):
            raise KubeError(
                f"the kubeconfig's user uses '{key}', which would run a program on the Orrery server: "
                "give a token or a client certificate inline",
                "kubeconfig",
            )
    for key in _FILE_KEYS:
        if cluster.get(key) or user.get(key):
            raise KubeError(
                f"the kubeconfig refers to a file ('{key}'): give its content inline ('{key}-data')",
                "kubeconfig",
            )
    if cluster.get("insecure-skip-tls-verify"):
        raise KubeError("insecure-skip-tls-verify is refused: give the cluster's CA", "kubeconfig")
    if user.get("username") or user.get("password"):
        raise KubeError("basic authentication is refused: give a token or a client certificate", "kubeconfig")
    server = str(cluster.get("server") or "")
    if not server.startswith("https://"):
        raise KubeError("the cluster's server must be an https:// URL", "kubeconfig")
    return Connection(
        url=server,
        ca=_b64(cluster.get("certificate-authority-data"), "certificate-authority-data"),
        token=str(user.get("token") or ""),
        client_cert=_b64(user.get("client-certificate-data"), "client-certificate-data"),
        client_key=_b64(user.get("client-key-data"), "client-key-data"),
        tls_server_name=str(cluster.get("tls-server-name") or ""),
    )


def connection_from(config: dict[str, Any], secret: dict[str, Any]) -> Connection:
    """The connection a cluster's stored settings describe."""
    if secret.get("kubeconfig"):
        return parse_kubeconfig(secret["kubeconfig"])
    return Connection(
        url=str(config.get("url") or ""), ca=secret.get("ca", ""), token=secret.get("token", "")
    )


def build_client(conn: Connection, *, verify: bool = True, credentials: bool = True) -> k8s.ApiClient:
    """An ``ApiClient`` for ``conn``, with no proxy and no retry (a dead server fails at once, not
    after urllib3's three tries). ``verify=False, credentials=False`` is the onboarding test's
    diagnosis call: it sends no credential, so it can be told the truth about a certificate."""
    configuration = k8s.Configuration(
        host=conn.url.rstrip("/"),
        ca_cert_data=(conn.ca or None) if verify else None,
        verify_ssl=verify,
        retries=False,
        proxy="",
        no_proxy="",
        tls_server_name=conn.tls_server_name or None,
    )
    if credentials:
        if conn.token:
            configuration.api_key = {"BearerToken": conn.token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        if conn.client_cert and conn.client_key:
            configuration.cert_file, configuration.key_file = _key_files(conn)
    return k8s.ApiClient(configuration)


_cache: dict[int, tuple[str, k8s.ApiClient]] = {}
_lock = threading.Lock()


def api_for(cluster: Cluster) -> k8s.ApiClient:
    """The cluster's client, cached per process and rebuilt when its secret or URL changed."""
    row = ClusterSecret.objects.filter(cluster=cluster).only("sealed").first()
    if row is None:
        raise KubeError(f"cluster {cluster.name} has no credential: onboard it again")
    conn = connection_from(cluster.config, row.data)
    key = conn.fingerprint()
    with _lock:
        cached = _cache.get(cluster.pk)
        if cached is not None and cached[0] == key:
            return cached[1]
        api = build_client(conn)
        _cache[cluster.pk] = (key, api)
    return api


def namespace_of(cluster: Cluster) -> str:
    return str(cluster.config.get("namespace") or "orrery")


def _items(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = doc.get(key) or []
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _b64(value: object, key: str) -> str:
    if not value:
        return ""
    try:
        return base64.b64decode(str(value), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise KubeError(f"'{key}' is not base64 of a PEM text", "kubeconfig") from None


_key_dir = None


def _key_files(conn: Connection) -> tuple[str, str]:
    """The client certificate and key as files (urllib3 reads only files), in a directory only
    this process's user can read, named by content so a rebuilt client reuses them."""
    global _key_dir
    if _key_dir is None:
        _key_dir = tempfile.mkdtemp(prefix="orrery-kube-")  # mode 0700
    digest = hashlib.sha256((conn.client_cert + conn.client_key).encode()).hexdigest()[:24]
    paths = []
    for suffix, text in (("crt", conn.client_cert), ("key", conn.client_key)):
        path = os.path.join(_key_dir, f"{digest}.{suffix}")
        if not os.path.exists(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        paths.append(path)
    return paths[0], paths[1]
