"""The heartbeat of train-mtp without a terminal: a line whenever nothing was logged for the
interval (issue 48: a run logged nothing for 3 minutes), none while other lines keep coming."""
import logging
import re
import time

import pytest

from pipespec.train.progress import Heartbeat, peak_rss_bytes, rss_bytes


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []

    def emit(self, record):
        self.records.append((time.monotonic(), record.getMessage()))


@pytest.fixture
def captured():
    root, handler = logging.getLogger(), _Records()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    yield handler.records
    root.removeHandler(handler)
    root.setLevel(level)


def test_a_silent_phase_gets_a_line_each_interval_with_its_status_and_memory(captured):
    t0 = time.monotonic()
    with Heartbeat(0.5) as beat:
        beat.status("training: step 3 of ~20 under way")
        time.sleep(1.8)                                   # one long step: nothing else logs
    beats = [(t, m) for t, m in captured if m.startswith("still running:")]
    assert len(beats) >= 3, captured
    gaps = [b - a for (a, _), (b, _) in zip([(t0, "")] + beats, beats)]
    assert max(gaps) < 0.5 + 0.3, gaps
    assert re.match(r"still running: training: step 3 of ~20 under way \(for [\d.]+ s; RSS [\d.]+ GB\)", beats[-1][1])


def test_no_heartbeat_while_other_lines_keep_coming_and_none_after_exit(captured):
    log = logging.getLogger("pipespec.train.test")
    with Heartbeat(0.5):
        for i in range(8):
            log.info("step %d", i)
            time.sleep(0.15)
    time.sleep(0.7)
    assert [m for _, m in captured] == [f"step {i}" for i in range(8)]
    with pytest.raises(ValueError, match="interval must be > 0"):
        Heartbeat(0)


def test_memory_figures_match_the_kernels_own():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    now, peak = rss_bytes(), peak_rss_bytes()
    assert abs(now - int(fields["VmRSS"].split()[0]) * 1024) < (32 << 20)
    assert peak >= now - (32 << 20) and abs(peak - int(fields["VmHWM"].split()[0]) * 1024) < (32 << 20)
