"""The one vocabulary of policies: names, budgets as text, submodule lists, and their errors."""

from __future__ import annotations

import pytest

from memfit.planning.budget import Budget
from memfit.planning.policy import BUDGET, NAMED, Policy, parse_policy


def test_names_parse_to_themselves_case_insensitively() -> None:
    for name in NAMED:
        assert parse_policy(name) == Policy(name)
        assert parse_policy(f" {name.upper()} ") == Policy(name)
    assert list(NAMED) == ["memory", "speed", "collection", "none", "swap"]


def test_budget_forms() -> None:
    assert parse_policy(0.5) == parse_policy("0.5") == Policy(BUDGET, budget=Budget(fraction=0.5))
    assert parse_policy(" 2GiB") == Policy(BUDGET, budget=Budget(bytes=2 * 2**30))
    assert parse_policy(4096).budget == parse_policy("4096").budget == Budget(bytes=4096)
    assert parse_policy(Budget(bytes=7)).budget == Budget(bytes=7)
    with pytest.raises(ValueError, match="cannot parse budget"):
        parse_policy("2lots")
    with pytest.raises(ValueError, match="fraction"):
        parse_policy(1.5)
    with pytest.raises(ValueError, match="removed"):
        parse_policy("budget=0.5")


def test_submodule_lists_are_collections() -> None:
    assert parse_policy(["a", "b.c"]) == Policy("collection", modules=("a", "b.c"))
    assert parse_policy(()) == Policy("collection")
    with pytest.raises(TypeError, match="5"):
        parse_policy(["a", 5])  # type: ignore[list-item]


def test_errors_name_the_value_and_what_is_accepted() -> None:
    with pytest.raises(ValueError) as info:
        parse_policy("memroy")
    assert "did you mean 'memory'" in str(info.value) and "'speed'" in str(info.value)
    with pytest.raises(ValueError, match="a budget"):
        parse_policy("fast")
    with pytest.raises(TypeError, match="NoneType"):
        parse_policy(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a budget"):
        Policy(BUDGET)
    with pytest.raises(ValueError, match="takes no budget"):
        Policy("memory", budget=Budget(fraction=0.5))
    with pytest.raises(ValueError, match="collection"):
        Policy("speed", modules=("a",))


def test_labels_and_calls() -> None:
    assert str(Policy("memory")) == "memory"
    assert Policy(BUDGET, budget=Budget(fraction=0.5)).label == "budget 50%"
    assert Policy(BUDGET, budget=Budget(bytes=3 * 2**20)).label == "budget 3.00 MiB"
    assert Policy("speed").call() == "memfit.checkpoint(model, 'speed')"
    assert Policy(BUDGET, budget=Budget(fraction=0.5)).call("m") == "memfit.checkpoint(m, 0.5)"
    assert Policy("collection", modules=("a",)).call() == "memfit.checkpoint(model, ['a'])"
    # measured under Inductor, the call says so: the other executor's plan peaks elsewhere
    assert Policy("memory").call(executor="inductor") == (
        "memfit.checkpoint(model, 'memory', executor='inductor')"
    )
    assert Policy(BUDGET, budget=Budget(fraction=0.5), autotune=True).call(executor="inductor") == (
        "memfit.checkpoint(model, 0.5, executor='inductor', options=memfit.Options(autotune=True))"
    )


def test_only_automatic_policies_fall_back_to_plain_autograd() -> None:
    assert Policy("memory").never_worse_than_none and Policy("speed").never_worse_than_none
    assert not Policy("collection").never_worse_than_none
    assert not Policy(BUDGET, budget=Budget(fraction=0.5)).never_worse_than_none


def test_autotune_is_a_bool_however_the_policy_is_made() -> None:
    # checked by Policy itself, so a memfit.Policy built by hand is held to it too
    with pytest.raises(TypeError, match="autotune is True or False"):
        Policy(BUDGET, budget=Budget(fraction=0.5), autotune="yes")  # type: ignore[arg-type]
