import pytest

from memfit.planning.budget import Budget, BudgetError, parse_budget


@pytest.mark.parametrize(
    "text,expected",
    [
        (1000, 1000),
        ("1000", 1000),
        ("1.5GiB", int(1.5 * 2**30)),
        ("800MB", 800 * 10**6),
        ("512KiB", 512 * 1024),
        ("2g", 2 * 2**30),
        (" 3 MiB ", 3 * 2**20),
        ("1e3", 1000),
    ],
)
def test_sizes_parse_to_bytes(text, expected):
    assert parse_budget(text) == Budget(bytes=expected)


def test_fractions_resolve_against_the_baseline_activations():
    assert parse_budget(0.25) == Budget(fraction=0.25)
    assert parse_budget("0.5") == Budget(fraction=0.5)
    # A peak of 1000 bytes of which 600 are saved activations: half the activations go.
    assert parse_budget(0.5).resolve(1000, 600) == 700
    assert parse_budget(1.0).resolve(1000, 600) == 1000
    assert parse_budget(1234).resolve(10**9, 10**8) == 1234


@pytest.mark.parametrize("bad", ["abc", "1XB", "-1GB", 0, -5, 1.5, 0.0, float("nan"), "2.5"])
def test_bad_budgets_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_budget(bad)


@pytest.mark.parametrize("bad", [True, None, [1]])
def test_wrong_types_raise_type_error(bad):
    with pytest.raises(TypeError):
        parse_budget(bad)


def test_budget_error_carries_the_smallest_achievable():
    err = BudgetError("too small", budget_bytes=10, least_bytes=20)
    assert isinstance(err, ValueError) and err.least_bytes == 20 and err.budget_bytes == 10
