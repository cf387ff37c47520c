"""A stage worker waiting, idle, for the driver's next plan.

That wait is unbounded (idle is not failure) and ends at once if the driver's connection closes.
The driver going away while a stage idles is no failure of the stage: it is how every stage ends
when the driver process was killed. So the worker logs a warning and leaves, instead of reporting
an error of its own.
"""
from __future__ import annotations

import logging

import torch

from pipespec.runtime.transport import HEADER_LEN, IDLE_TIMEOUT, Link, StageError

logger = logging.getLogger(__name__)


def next_plan_header(link: Link, rank: int) -> torch.Tensor | None:
    """The next plan header from the driver; None if the driver has gone."""
    try:
        return link.recv((HEADER_LEN,), torch.int64, 0, "plan.header", IDLE_TIMEOUT)
    except StageError as e:
        logger.warning("stage %d: the driver went away while the stage was idle (%s); leaving", rank, e)
        return None
