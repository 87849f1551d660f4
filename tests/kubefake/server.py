"""``FakeKube``: start/stop the fake API server, its identities, TLS, and the hooks tests steer it with.

The HTTP surface (what the adapter sees) is in :mod:`tests.kubefake.http`; the methods here are the
*test side*: they play the parts of a cluster no API server contains (the kubelet registering GPU
nodes, a node going NotReady, a kubelet that cannot be reached, etcd compaction). They go through
the same :class:`~tests.kubefake.api.Cluster` rules, so what a client then reads is what a real
server would answer.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import ipaddress
import secrets
import ssl
import tempfile
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests.kubefake.api import Cluster, rfc3339
from tests.kubefake.errors import ApiError, status
from tests.kubefake.http import Handler
from tests.kubefake.rbac import Authorizer, User
from tests.kubefake.resources import RESOURCES
from tests.kubefake.store import Entry, Store

RBAC_FILE = Path(__file__).parent / "rbac.yaml"
ADMIN = User("envtest-admin", ("system:masters", "system:authenticated"), uid="envtest-admin-uid")
ADAPTER = User("orrery-adapter", ("system:authenticated",), uid="orrery-adapter-uid")
UNBOUND = User("envtest-user", ("envtest:users", "system:authenticated"), uid="envtest-user-uid")
_KIND_PLURALS = {r.kind: r.plural for r in RESOURCES.values()}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class FakeKube:
    """A loopback kube-apiserver look-alike. Use as a context manager or call start()/stop().

    ``namespaces`` are created at start; ``adapter_rbac`` applies ``rbac.yaml`` (the adapter's minimal
    Role/ClusterRole) so ``adapter_token`` has exactly the rights the docs grant. ``tls`` serves HTTPS
    with a CA generated for this instance (``ca_file``).
    """

    def __init__(
        self,
        *,
        tls: bool = True,
        namespaces: tuple[str, ...] = ("orrery",),
        adapter_rbac: bool = True,
        watch_cache: bool = True,
        bookmark_interval: float = 60.0,
        bookmark_before_timeout: float = 2.0,
        default_watch_seconds: float = 1800.0,
        max_watch_seconds: float | None = None,
        future_rv_wait: float = 3.0,
        watch_cache_size: int = 10_000,
    ):
        self.store = Store(watch_cache_size=watch_cache_size)
        self.clock = time.time
        self.cluster = Cluster(self.store, clock=lambda: self.clock())
        self.authorizer = Authorizer(self.store)
        self.tls = tls
        self.watch_cache = watch_cache
        self.bookmark_interval = bookmark_interval
        self.bookmark_before_timeout = bookmark_before_timeout
        self.default_watch_seconds = default_watch_seconds
        self.max_watch_seconds = max_watch_seconds
        self.future_rv_wait = future_rv_wait
        self.stopping = False
        self.admin_token = "admin-" + secrets.token_hex(16)
        self.adapter_token = "adapter-" + secrets.token_hex(16)
        self.unbound_token = "unbound-" + secrets.token_hex(16)
        self.users: dict[str, User] = {
            self.admin_token: ADMIN,
            self.adapter_token: ADAPTER,
            self.unbound_token: UNBOUND,
        }
        self._namespaces = namespaces
        self._adapter_rbac = adapter_rbac
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kubefake-")
        self.ca_file: str | None = None
        self.ca_pem: bytes = b""

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> FakeKube:
        handler = type("BoundHandler", (Handler,), {"fake": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        if self.tls:
            context = self._tls_context()
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kubefake", daemon=True)
        self._thread.start()
        for namespace in self._namespaces:
            self.cluster.create("namespaces", "", {"metadata": {"name": namespace}}, manager="kubefake")
        if self._adapter_rbac:
            self.apply_rbac(RBAC_FILE.read_text())
        return self

    def stop(self) -> None:
        self.stopping = True
        self.store.close_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._dir.cleanup()

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_address[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}"

    # -- identities ---------------------------------------------------------------------------
    def token_for(self, user: str) -> str:
        """The token of ``admin``, ``adapter`` or ``unbound``."""
        return {"admin": self.admin_token, "adapter": self.adapter_token, "unbound": self.unbound_token}[user]

    def add_user(self, name: str, groups: tuple[str, ...] = ("system:authenticated",)) -> str:
        """A new static-token user (no bindings); returns its token."""
        token = f"user-{secrets.token_hex(16)}"
        self.users[token] = User(name, groups, uid=f"{name}-uid")
        return token

    def kubeconfig(self, user: str = "adapter", *, namespace: str = "orrery") -> str:
        """A kubeconfig document for ``user`` (admin/adapter/unbound), CA embedded when TLS is on."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kubefake",
                "clusters": [{"name": "kubefake", "cluster": cluster}],
                "users": [{"name": user, "user": {"token": self.token_for(user)}}],
                "contexts": [
                    {
                        "name": "kubefake",
                        "context": {"cluster": "kubefake", "user": user, "namespace": namespace},
                    }
                ],
            },
            sort_keys=False,
        )

    def kubeconfig_file(self, user: str = "adapter") -> str:
        path = Path(self._dir.name) / f"kubeconfig-{user}"
        path.write_text(self.kubeconfig(user))
        return str(path)

    def token_request(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST serviceaccounts/NAME/token: mint a token that authenticates as the ServiceAccount."""
        account = self.cluster.get("serviceaccounts", namespace, name).obj
        seconds = int((body.get("spec") or {}).get("expirationSeconds") or 3600)
        token = "sa-" + secrets.token_hex(24)
        self.users[token] = User(
            f"system:serviceaccount:{namespace}:{name}",
            ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
            uid=account["metadata"]["uid"],
            extra={"authentication.kubernetes.io/credential-id": [f"JTI={uuid.uuid4()}"]},
        )
        now = self.clock()
        return {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "creationTimestamp": rfc3339(now),
                "managedFields": [
                    {
                        "manager": "kubefake",
                        "operation": "Update",
                        "apiVersion": "authentication.k8s.io/v1",
                        "time": rfc3339(now),
                        "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:spec": {"f:expirationSeconds": {}}},
                        "subresource": "token",
                    }
                ],
            },
            "spec": {
                "audiences": [self.url],
                "expirationSeconds": seconds,
                "boundObjectRef": None,
            },
            "status": {"token": token, "expirationTimestamp": rfc3339(now + seconds)},
        }

    def apply_rbac(self, text: str) -> None:
        """Create every object of a multi-document YAML (ServiceAccounts, Roles, Bindings) as admin."""
        for document in yaml.safe_load_all(text):
            if not document:
                continue
            plural = _KIND_PLURALS[document["kind"]]
            namespace = document.get("metadata", {}).get("namespace", "")
            self.cluster.create(plural, namespace, document, manager="kubefake")

    # -- time and history ---------------------------------------------------------------------
    def wait_for_rv(self, wanted: int) -> None:
        """A LIST at a future RV: wait for it, then 504 Timeout as the server does after ~3 s (037)."""
        deadline = time.monotonic() + self.future_rv_wait
        while time.monotonic() < deadline:
            if self.store.rv >= wanted:
                return
            time.sleep(0.01)
        message = f"Timeout: Too large resource version: {wanted}, current: {self.store.rv}"
        details = {
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": 1,
        }
        raise ApiError(504, status(504, message, "Timeout", details))

    def compact(self, rv: int | None = None) -> int:
        """etcd compaction: Exact LISTs and continue tokens at or before ``rv`` answer 410."""
        return self.store.compact(rv)

    def expire_watch_cache(self, resource: str | None = None) -> None:
        """Watches from any RV seen so far now get the 410 ERROR event (the cache's window moved on)."""
        self.store.expire_watch_cache(resource)

    @property
    def resource_version(self) -> int:
        return self.store.rv

    # -- nodes (what kubelets and GPU feature discovery would write) --------------------------
    def add_gpu_node(
        self,
        name: str,
        *,
        gpus: int = 8,
        product: str = "NVIDIA-H100-80GB-HBM3",
        memory_mib: int = 81559,
        mig: dict[str, int] | None = None,
        ready: bool = True,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
        address: str = "127.0.0.1",
        cpu: str = "224",
        memory: str = "2113470612Ki",
    ) -> dict[str, Any]:
        """Register a node as a kubelet with NVIDIA GFD labels would (010, 011, 012), status included."""
        node_labels = {
            "kubernetes.io/arch": "amd64",
            "kubernetes.io/os": "linux",
            "kubernetes.io/hostname": name,
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(gpus),
            "nvidia.com/gpu.memory": str(memory_mib),
            "nvidia.com/mig.strategy": "mixed" if mig else "single",
        }
        resources = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(0 if mig else gpus)}
        for profile, count in (mig or {}).items():
            node_labels[f"nvidia.com/{profile}.count"] = str(count)
            resources[f"nvidia.com/{profile}"] = str(count)
        node_labels.update(labels or {})
        body: dict[str, Any] = {"metadata": {"name": name, "labels": node_labels}}
        if taints:
            body["spec"] = {"taints": taints}
        self.cluster.create("nodes", "", body, manager="kubelet")
        now = rfc3339(self.clock())
        status_patch = {
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [_ready_condition(ready, now)],
                "addresses": [
                    {"type": "InternalIP", "address": address},
                    {"type": "Hostname", "address": name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {
                    "kubeletVersion": "v1.33.3",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                    "containerRuntimeVersion": "containerd://1.7.27",
                },
            }
        }
        return self.cluster.patch(
            "nodes",
            "",
            name,
            status_patch,
            "application/strategic-merge-patch+json",
            subresource="status",
            manager="kubelet",
        ).full()

    def set_node_ready(self, name: str, ready: bool) -> dict[str, Any]:
        """The kubelet reports Ready=True/False (or, for False, the node controller marks it Unknown)."""
        patch = {"status": {"conditions": [_ready_condition(ready, rfc3339(self.clock()))]}}
        return self.cluster.patch(
            "nodes",
            "",
            name,
            patch,
            "application/strategic-merge-patch+json",
            subresource="status",
            manager="kubelet",
        ).full()

    def cordon(self, name: str, unschedulable: bool = True) -> dict[str, Any]:
        patch = {"spec": {"unschedulable": True if unschedulable else None}}
        return self.cluster.patch(
            "nodes", "", name, patch, "application/strategic-merge-patch+json", manager="kubectl"
        ).full()

    def patch_node(self, name: str, patch: dict[str, Any], *, status: bool = False) -> dict[str, Any]:
        return self.cluster.patch(
            "nodes",
            "",
            name,
            patch,
            "application/strategic-merge-patch+json",
            subresource="status" if status else "",
            manager="kubelet",
        ).full()

    def delete_node(self, name: str) -> None:
        self.cluster.delete("nodes", "", name, {})

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        """Read an object directly (not through HTTP); None when missing."""
        resource = RESOURCES[plural]
        entry: Entry | None = self.store.get(plural, f"{namespace}/{name}" if resource.namespaced else name)
        return copy.deepcopy(entry.full()) if entry else None

    def objects(self, plural: str, namespace: str = "") -> list[dict[str, Any]]:
        return [copy.deepcopy(e.full()) for _, e in self.store.items(plural, namespace)]

    # -- logs ---------------------------------------------------------------------------------
    def set_pod_log(self, namespace: str, pod: str, text: str, container: str = "main") -> None:
        """What the kubelet would stream for ``pods/NAME/log`` (there is no kubelet here)."""
        self.cluster.logs[(namespace, pod, container)] = text

    def set_kubelet_reachable(self, node: str, reachable: bool) -> None:
        """Unreachable: pods/log on this node answers the apiserver's 500 dial error (063)."""
        (self.cluster.unreachable_kubelets.discard if reachable else self.cluster.unreachable_kubelets.add)(
            node
        )

    # -- TLS ----------------------------------------------------------------------------------
    def _tls_context(self) -> ssl.SSLContext:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = dt.datetime.now(dt.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubefake-ca")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        directory = Path(self._dir.name)
        self.ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        (directory / "ca.crt").write_bytes(self.ca_pem)
        (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / "tls.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        self.ca_file = str(directory / "ca.crt")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(directory / "tls.crt", directory / "tls.key")
        return context


def _ready_condition(ready: bool, now: str) -> dict[str, Any]:
    return {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletNotReady",
        "message": "kubelet is posting ready status" if ready else "container runtime is down",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
