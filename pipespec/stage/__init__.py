"""One pipeline position's work for a step: `Stage.step(plan, inbound) -> outbound`."""
from pipespec.stage.stage import Stage

__all__ = ["Stage"]
