"""Every target family and the MTP proposer offer what a stage asks of them (`stage/interfaces.py`),
with the protocols' parameter names, so the stage calls them without duck typing."""
from __future__ import annotations

import inspect

import pytest

from pipespec.model.registry import TARGETS
from pipespec.speculative.proposer import MTPProposer
from pipespec.stage.interfaces import Drafter, TargetModel


def _methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def _check(cls, protocol) -> list[str]:
    problems = []
    for name, want in _methods(protocol).items():
        fn = getattr(cls, name, None)
        if fn is None:
            problems.append(f"{cls.__name__} lacks {name}")
        elif list(inspect.signature(fn).parameters) != list(want.parameters):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(fn)} differs from {want}")
    for name in getattr(protocol, "__annotations__", {}):
        if name not in ("arch", "model", "kv_caches") and not hasattr(cls, name):
            problems.append(f"{cls.__name__} lacks attribute {name}")
    return problems


@pytest.mark.parametrize("family", sorted(set(TARGETS.values()), key=lambda c: c.__name__))
def test_every_family_is_a_target_model(family):
    assert _check(family, TargetModel) == []


def test_the_mtp_proposer_is_a_drafter():
    assert _check(MTPProposer, Drafter) == []


def test_the_check_catches_a_missing_method():
    class Partial:
        def forward(self, ctx, input_ids=None, hidden=None, residual=None):
            return None

    problems = _check(Partial, TargetModel)
    assert "Partial lacks compute_logits" in problems and "Partial lacks attribute reference_attention_only" in problems
