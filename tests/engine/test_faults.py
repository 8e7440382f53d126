"""GRISTMILL_FAULTS parsing."""

from __future__ import annotations

import pytest

from gristmill import faults


def test_parse_points_and_triggers():
    parsed = faults.parse("detokenize_init@prompt~BOOM, core_exit@step=40,forward")
    assert parsed == (faults.Fault("detokenize_init", prompt_contains="BOOM"),
                      faults.Fault("core_exit", step=40), faults.Fault("forward"))
    assert parsed[0].matches("a BOOM here", None) and not parsed[0].matches("fine", None)
    assert not parsed[0].matches(None, 3)
    assert parsed[1].matches(None, 40) and not parsed[1].matches(None, 39)
    assert parsed[2].matches("anything", 1)


def test_unset_means_off():
    assert faults.parse(None) == () and faults.parse("  ") == ()


@pytest.mark.parametrize("spec,says", [
    ("explode", "unknown fault point 'explode'"),
    ("forward@when=3", "bad trigger 'when=3'"),
    ("forward@step=x", "bad trigger 'step=x'"),
    ("tokenize@prompt~", "bad trigger 'prompt~'"),
])
def test_malformed_spec_is_a_clear_error(spec, says):
    with pytest.raises(ValueError) as info:
        faults.parse(spec)
    assert says in str(info.value) and "GRISTMILL_FAULTS" in str(info.value)


def test_check_raises_only_when_active(monkeypatch):
    monkeypatch.setenv("GRISTMILL_FAULTS", "tokenize@prompt~BOOM")
    faults.load()
    try:
        faults.check("tokenize", prompt="no trigger here")
        with pytest.raises(faults.InjectedFault, match="tokenize"):
            faults.check("tokenize", prompt="BOOM")
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS")
        faults.load()
    faults.check("tokenize", prompt="BOOM")  # off again
