from tests.kubefake.plugin import kube, kube_client  # noqa: F401
