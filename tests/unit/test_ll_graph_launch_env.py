"""PORTEP_LL_GRAPH_LAUNCH (python/portep/config.py, read by the CUDA engine): on by default, 0 turns the CUDA-graph
launches of eager LL calls off, anything else is refused with the variable and its value named."""

import pytest

from portep.config import ll_graph_launch


def test_graph_launch_is_on_by_default(monkeypatch):
    monkeypatch.delenv("PORTEP_LL_GRAPH_LAUNCH", raising=False)
    assert ll_graph_launch() is True


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False)])
def test_graph_launch_follows_the_variable(monkeypatch, raw, want):
    monkeypatch.setenv("PORTEP_LL_GRAPH_LAUNCH", raw)
    assert ll_graph_launch() is want


@pytest.mark.parametrize("raw", ["yes", "", "2", "off"])
def test_other_values_are_refused(monkeypatch, raw):
    monkeypatch.setenv("PORTEP_LL_GRAPH_LAUNCH", raw)
    with pytest.raises(ValueError, match=f"PORTEP_LL_GRAPH_LAUNCH={raw!r} must be 0 or 1"):
        ll_graph_launch()
