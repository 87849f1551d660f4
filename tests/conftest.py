import pytest

from tests.factories import make_cluster, make_node, make_project, make_queue, make_user


@pytest.fixture
def alice(db):
    return make_user("alice")


@pytest.fixture
def bob(db):
    return make_user("bob")


@pytest.fixture
def operator(db):
    return make_user("ops", staff=True)


@pytest.fixture
def vision(alice):
    return make_project("vision", members=(alice,))


@pytest.fixture
def queue(vision):
    return make_queue(vision)


@pytest.fixture
def node(db):
    return make_node(make_cluster("sim-a"), gpus=8, model="h100", name="a-n001")
