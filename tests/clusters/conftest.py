import pytest

from clusters.ingest.buffer import get_buffer
from clusters.services.aggregation import forget_catalog
from clusters.services.credentials import forget_cached_identities


@pytest.fixture(autouse=True)
def clean_pipeline():
    """Each test starts with an empty heartbeat buffer and cold caches."""
    get_buffer().clear()
    forget_cached_identities()
    forget_catalog()
    yield
    get_buffer().clear()
