"""The switches of python/portep/config.py read from the environment, each with its default, the values it takes and
a refusal of anything else that names the variable and its value:
- PORTEP_LL_GRAPH_LAUNCH (read by the CUDA engine): on by default, 0 turns the CUDA-graph launches of eager LL
  calls off."""

import pytest

from portep.config import ll_graph_launch

# variable, reader, its value when unset, {setting: value}, refused settings, the refusal's ending
SWITCHES = [
    pytest.param(
        "PORTEP_LL_GRAPH_LAUNCH",
        ll_graph_launch,
        True,
        {"1": True, "0": False},
        ["yes", "", "2", "off"],
        "must be 0 or 1",
        id="ll-graph-launch",
    ),
]


@pytest.mark.parametrize("var,read,default,values,refused,message", SWITCHES)
def test_each_switch_has_its_default_takes_its_values_and_refuses_others(
    monkeypatch, var, read, default, values, refused, message
):
    monkeypatch.delenv(var, raising=False)
    assert read() == default and type(read()) is type(default)
    for raw, want in values.items():
        monkeypatch.setenv(var, raw)
        assert read() == want and type(read()) is type(want), raw
    for raw in refused:
        monkeypatch.setenv(var, raw)
        with pytest.raises(ValueError, match=f"{var}={raw!r} {message}"):
            read()
