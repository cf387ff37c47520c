"""A live `pipespec serve` process on a free port, shared by the server tests, and the official openai
client on it."""
import pytest
from openai import OpenAI

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


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
