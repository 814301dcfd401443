"""PORTEP_HT_COMBINE_SENDER (python/portep/config.py, read when a CUDA Buffer sets up its normal mode): the combine's
sender block serves the sources one after another by default (`ordered`), every ring at once with `lanes`;
anything else is refused with the variable and its value named."""

import pytest

from portep.config import ht_combine_sender_lanes


def test_the_ordered_sender_is_the_default(monkeypatch):
    monkeypatch.delenv("PORTEP_HT_COMBINE_SENDER", raising=False)
    assert ht_combine_sender_lanes() is False


@pytest.mark.parametrize("raw,want", [("ordered", False), ("lanes", True)])
def test_the_sender_follows_the_variable(monkeypatch, raw, want):
    monkeypatch.setenv("PORTEP_HT_COMBINE_SENDER", raw)
    assert ht_combine_sender_lanes() is want


@pytest.mark.parametrize("raw", ["", "Lanes", "1", "round-robin"])
def test_other_values_are_refused(monkeypatch, raw):
    monkeypatch.setenv("PORTEP_HT_COMBINE_SENDER", raw)
    with pytest.raises(ValueError, match=f"PORTEP_HT_COMBINE_SENDER={raw!r} must be 'ordered' or 'lanes'"):
        ht_combine_sender_lanes()
