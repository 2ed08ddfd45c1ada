import pytest


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    """The app on a real two-node Ray cluster (tests/scale/cluster.py), started once for this
    package and stopped after it, so no Ray process outlives these tests."""
    from tests.scale.cluster import TwoNodeCluster

    c = TwoNodeCluster(tmp_path_factory.mktemp("two-nodes"))
    c.start()
    yield c
    c.stop()
