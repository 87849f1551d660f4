"""A fake Kubernetes API server for Orrery's tests.

It is a fake because no real kube-apiserver (nor etcd) can run on the machines these tests run on.
It speaks kube-apiserver v1.33's JSON over loopback HTTP/1.1 (or HTTPS with a CA it generates) to
the official Python client, and it is checked against recordings of a real server
(``tests/kubefake/recordings/``, replayed by ``test_recordings.py``).

What it models:
- discovery (``/version``, ``/api``, ``/apis``, ``/api/v1``, ``/apis/batch/v1``);
- Nodes, Namespaces, Pods, Services, batch/v1 Jobs (plus ServiceAccounts, ConfigMaps, Secrets and RBAC
  objects as plain storage): create/get/list/watch/update/patch/delete, the ``status`` subresource,
  ``pods/binding``, ``pods/log``, ServiceAccount TokenRequest;
- one global resourceVersion; server-filled defaults; quantity canonicalisation; generation;
  no-op writes; 409/404/422/400/410/413/500/504 Status bodies as the server writes them;
- LIST with label and field selectors, ``limit``/``continue``, ``remainingItemCount``,
  ``resourceVersion``/``resourceVersionMatch`` (Exact reads from history, 410 after compaction);
- WATCH with synthetic ADDED, replay from an RV, selector enter/leave, bookmarks (interval
  configurable), ``timeoutSeconds``, the 410 ERROR event once the watch cache's window moved on;
- bearer-token authentication, RBAC over stored Roles/Bindings (``rbac.yaml`` for the adapter user),
  SelfSubjectAccessReview / SelfSubjectRulesReview / SelfSubjectReview;
- the test side (:class:`FakeKube` methods) plays the kubelet and GPU feature discovery for nodes
  (``add_gpu_node``, ``set_node_ready``, ``cordon``, ``delete_node``), the kubelet's logs
  (``set_pod_log``, ``set_kubelet_reachable``), etcd compaction and the watch cache's window.

What it does not model: the controllers around the server (Job controller, scheduler, kubelet,
garbage collector, node lifecycle, namespace controller): like the recorded server, nothing creates
pods for a Job or moves them by itself; a test plays those parts through the API. Nor: admission
webhooks, server-side apply (``managedFields`` is approximate),
protobuf, API priority and fairness, field validation beyond the checks in ``validation.py``,
quota and limit ranges, any resource not listed above, and the real server's timing.
"""

from tests.kubefake.server import FakeKube

__all__ = ["FakeKube"]
