"""Command-line values: budgets, devices, dtypes, policies, shapes; each bad one a CliError."""

from __future__ import annotations

import pytest
import torch

from memfit.cli.arguments import (
    parse_batch_budget,
    parse_device,
    parse_dtype,
    parse_policies,
    parse_shape,
)
from memfit.cli.errors import CliError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1048576", 2**20),
        ("1.5GiB", 3 * 2**29),
        ("800MB", 800 * 10**6),
        ("512KiB", 2**19),
        ("2g", 2 * 2**30),
    ],
)
def test_budget_forms(text: str, expected: int) -> None:
    assert parse_batch_budget(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("lots", "cannot parse budget"),
        ("1.5 gigs", "cannot parse budget"),
        ("0.5", "is a fraction"),
        ("0", "less than one byte"),
        ("", "cannot parse budget"),
    ],
)
def test_bad_budgets(text: str, message: str) -> None:
    with pytest.raises(CliError, match=message):
        parse_batch_budget(text)


def test_devices() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(CliError, match="does not exist"):
        parse_device("cuda:99")
    with pytest.raises(CliError, match="only CPU and CUDA"):
        parse_device("meta")
    with pytest.raises(CliError, match="not a device name"):
        parse_device("gpu0")


def test_dtypes_modes_shapes() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(None) is None
    with pytest.raises(CliError, match="floating-point"):
        parse_dtype("int8")
    labels = [m.label for m in parse_policies("memory, speed,memory,0.5,64MiB")]
    assert labels == ["none", "memory", "speed", "budget 50%", "budget 64.00 MiB"]
    assert parse_policies("none")[0].call() == "memfit.checkpoint(model, 'none')"
    assert parse_policies("0.25")[1].call() == "memfit.checkpoint(model, 0.25)"
    with pytest.raises(CliError, match="'fast' is not a policy"):
        parse_policies("fast")
    assert parse_shape("8,3,32,32") == parse_shape("8x3x32x32") == (8, 3, 32, 32)
    for bad in ("", "8,0", "8,x", "a"):
        with pytest.raises(CliError, match="is not a shape"):
            parse_shape(bad)


def test_autotune_marks_every_budget_and_needs_one() -> None:
    policies = parse_policies("memory,0.5", autotune=True)
    assert [p.label for p in policies] == ["none", "memory", "budget 50% + autotune"]
    assert policies[2].call() == (
        "memfit.checkpoint(model, 0.5, executor='inductor', options=memfit.Options(autotune=True))"
    )
    with pytest.raises(CliError, match="names no budget"):
        parse_policies("memory,speed", autotune=True)


def test_offload_adds_swap_and_offload_twins() -> None:
    labels = [p.label for p in parse_policies("speed,memory,0.5", offload=True)]
    assert labels == [
        "none",
        "speed",
        "memory",
        "budget 50%",
        "memory + offload",
        "budget 50% + offload",
        "swap",
    ]
    assert parse_policies("memory", offload=True)[2].call() == (
        "memfit.checkpoint(model, 'memory', offload=True)"
    )
