"""The report's schema validator: it must reject what the schema forbids (a validator that accepts
everything would make the profile test's schema check meaningless)."""

from __future__ import annotations

from memfit.cli.report import REPORT_SCHEMA, validate

MODULE = REPORT_SCHEMA["properties"]["activations"]["properties"]["by_module"]["items"]


def test_validator_keywords() -> None:
    good = {"module": "a", "type": "Linear", "self_bytes": 4, "total_bytes": 8, "tensors": 1}
    assert validate(good, MODULE) == []
    assert validate({**good, "self_bytes": -1}, MODULE) == [
        "$.self_bytes: -1 is below the minimum 0"
    ]
    assert any("expected integer" in e for e in validate({**good, "tensors": 1.5}, MODULE))
    assert any("expected integer" in e for e in validate({**good, "tensors": True}, MODULE))
    missing = dict(good)
    del missing["type"]
    assert validate(missing, MODULE) == ["$: missing required key 'type'"]
    assert validate({**good, "extra": 1}, MODULE) == ["$: unexpected key 'extra'"]
    assert validate([good], {"type": "array", "items": MODULE}) == []
    assert validate([{}], {"type": "array", "items": MODULE})[0].startswith("$[0]: missing")


def test_nullable_and_enum_parts_of_the_report_schema() -> None:
    props = REPORT_SCHEMA["properties"]
    assert validate(None, props["max_batch"]) == [] and validate(None, props["pareto"]) == []
    assert validate("x", props["max_batch"]) != []
    assert validate("memfit-profile/1", props["schema"]) != []  # the old layout ("modes")
    policy = props["policies"]["items"]["properties"]["policy"]
    assert validate("budget", policy) == [] and validate("fast", policy) != []
    assert set(REPORT_SCHEMA["required"]) == set(props)  # every key is always present
