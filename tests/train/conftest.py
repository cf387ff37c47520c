"""Fixtures of the training tests."""
import pytest


@pytest.fixture(scope="module")
def default_source():
    """The default model's source (its arch and tokenizer); the test skips where it is not installed."""
    from pipespec.checkpoint.source import resolve_model
    try:
        return resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
