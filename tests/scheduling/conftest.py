import pytest

from tests.factories import make_cluster, make_node


@pytest.fixture
def fleet():
    """Three 8-GPU nodes on two simulated clusters: a0 and a1 on sim-a, b0 on sim-b."""
    a, b = make_cluster("sim-a"), make_cluster("sim-b")
    return [make_node(a, gpus=8, name=f"a{i}") for i in range(2)] + [make_node(b, gpus=8, name="b0")]
