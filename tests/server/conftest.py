"""A live `pipespec serve` process on a free port, shared by the server tests."""
import pytest

from tests.live_server import LiveServer


@pytest.fixture(scope="session")
def server():
    s = LiveServer("--max-num-seqs", "32", "--api-key", "sk-test", "--max-queued-requests", "64")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def small_server():
    """A short context (32 tokens) so that fuzzed requests stay cheap."""
    s = LiveServer("--max-model-len", "32", "--max-num-seqs", "8")
    yield s
    s.stop()
