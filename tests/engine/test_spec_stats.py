"""The periodic speculative-decoding log line covers an interval of drafting, not the first step."""
from pipespec.engine.spec_stats import SpecDecodeStats


def test_first_summary_comes_an_interval_after_the_first_draft():
    stats = SpecDecodeStats(3)
    due = []
    for t in (100.0, 100.1, 105.0, 109.9, 110.0, 111.0, 119.9, 120.0):   # seconds, one draft each
        stats.record(3, 1)
        due.append(stats.log_due(t, every=10.0))
    assert due == [False, False, False, False, True, False, False, True]
