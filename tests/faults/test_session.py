"""The fault session's table of engine faults covers every engine fault kind a plan can name."""

from __future__ import annotations

from faults.session import ENGINE_FAULTS
from faults.window import FaultKind, Layer


def test_every_engine_fault_kind_is_registered_once():
    assert set(ENGINE_FAULTS) == {kind for kind in FaultKind if kind.layer is Layer.ENGINE}
