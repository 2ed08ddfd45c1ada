import pytest


@pytest.fixture(scope="package")
def server():
    """The real app (`serve run serve_config.yaml`), started once for the end-to-end tests of this
    package and stopped after them, so its replicas do not compete with the other tests."""
    from tests.e2e.serve_process import ServeProcess

    proc = ServeProcess()
    proc.start()
    yield proc
    proc.stop()
