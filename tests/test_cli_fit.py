"""``memfit fit``: a factory's model end to end (slow: a subprocess planning on CPU), a Hugging
Face config built on the meta device with memfit.plan's meta planning stood in for, and the
errors a user can make, each in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from clitools import ROOT, run_memfit
from memfit.cli import main
from memfit.fitting import step_plan
from memfit.planning.plan import GraphPlan, Plan

FACTORY = str(ROOT / "tests" / "cli_factories.py") + ":tiny_mlp"


@pytest.mark.slow
def test_a_factory_end_to_end(tmp_path: Path) -> None:
    png = tmp_path / "fit.png"
    done = run_memfit(
        "fit", FACTORY, "--device", "l4", "--capacity", "520MiB", "--policies", "none,memory",
        "--batch", "16", "--json", "--png", str(png),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["device"] == "l4" and report["usable_bytes"] == 8 * 2**20
    assert [r["policy"] for r in report["rows"]] == ["none", "memory"]
    for row in report["rows"]:
        assert row["batch"] == 16 and row["fits"] and row["largest_batch"] > 16
        assert row["exact"] and row["step_seconds"] > 0
        assert row["peak_bytes"] <= report["usable_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_device_and_optimizer_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", FACTORY, "--device", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert "unknown device 'tpu-v9'" in err and "h100-80gb" in err and "rtx-4090" in err
    assert main(["fit", FACTORY, "--optimizer", "lion"]) == 2
    assert "'lion' is not modelled" in capsys.readouterr().err
    assert main(["fit", FACTORY, "--capacity", "100MiB"]) == 2
    assert "at most the CUDA context" in capsys.readouterr().err


def test_what_is_a_config_and_what_a_factory() -> None:
    from memfit.cli.fit import _is_config

    assert not _is_config(FACTORY)
    assert not _is_config("package.module:Class.method")
    assert _is_config("meta-llama/Llama-3.1-8B") and _is_config(str(ROOT / "tests"))


@pytest.mark.slow  # imports transformers
def test_a_config_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", str(ROOT / "no-such-config.json")]) == 2
    assert "local Hugging Face cache" in capsys.readouterr().err


@pytest.fixture
def llama_config(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    ).save_pretrained(tmp_path)  # fmt: skip
    return tmp_path / "config.json"


def _plan(peak: int) -> Plan:
    graph = GraphPlan(
        policy="none", decisions={}, kept=(), recomputed=(), kept_bytes=peak,
        predicted_peak_bytes=peak, baseline_peak_bytes=peak, baseline_kept_bytes=peak,
        recompute_flops=0, forward_flops=10**9, num_nodes=1,
    )  # fmt: skip
    return Plan("none", (graph,))


@pytest.mark.slow  # imports transformers
def test_a_config_is_built_on_meta_and_planned_for_the_device(
    llama_config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """memfit.plan's meta planning stood in for (a peak of 1 MiB per token): the config's model
    is built on the meta device, its inputs are meta ids and labels of --batch x --seq, and
    each plan is asked for the device's type."""
    calls: list[dict[str, Any]] = []

    def plan(model: Any, *args: Any, policy: Any, device: str = "cpu", **kwargs: Any) -> Plan:
        ids = kwargs["input_ids"]
        assert next(model.parameters()).is_meta and ids.is_meta and kwargs["labels"] is ids
        calls.append({"device": device, "shape": tuple(ids.shape)})
        return _plan(ids.numel() * 2**20)

    monkeypatch.setattr(step_plan, "memfit_plan", plan)
    args = ["fit", str(llama_config), "--device", "h100-80gb", "--batch", "4", "--seq", "32"]
    assert main([*args, "--policies", "none", "--json", "--dtype", "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert calls[0] == {"device": "cuda", "shape": (4, 32)}
    assert all(c["device"] == "cuda" for c in calls)
    assert row["batch"] == 4 and row["seq"] == 32 and row["fits"]
    usable = report["usable_bytes"]
    # a token's MiB, less what the weights, the batch and the optimizer hold: the answer's plan
    # fits and the next one's does not
    held = row["peak_bytes"] - 128 * 2**20
    assert row["largest_batch"] * 32 * 2**20 + held <= usable
    assert (row["largest_batch"] + 1) * 32 * 2**20 + held > usable
    assert row["largest_seq"] == 64  # the config's max_position_embeddings: the search stops
    assert len(calls) <= 1 + 3 + 4  # the asked size, then each search in a few plans

    # nothing fits at --batch 4096: the last line says what would
    assert main([*args[:5], "4096", "--seq", "32", "--policies", "none"]) == 1
    out = capsys.readouterr()
    assert "policy" in out.out and "no" in out.out
    assert "batch 4096 fits under no policy on h100-80gb" in out.err
    assert "'none' batch" in out.err


@pytest.mark.slow  # imports transformers, plans twice on fake tensors
def test_a_config_is_planned_on_meta_tensors_for_the_device(
    llama_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No stand-in: the config's model is built on the meta device and planned by memfit.plan on
    fake tensors for an H100; the weights, gradients and AdamW's state are the model's own in
    bf16 (the weights with its buffers), and the least-memory plan is no larger than keeping
    everything."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(llama_config.parent)
    params = list(transformers.AutoModelForCausalLM.from_config(config).parameters())
    # bf16, each tensor in whole 512-byte blocks of the CUDA caching allocator
    blocks = sum(-(-2 * p.numel() // 512) * 512 for p in params)
    args = ["fit", str(llama_config), "--device", "h100-80gb", "--batch", "2", "--seq", "16"]
    assert main([*args, "--dtype", "bfloat16", "--policies", "none,memory", "--no-search",
                 "--json"]) == 0  # fmt: skip
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"none", "memory"}
    for row in rows.values():
        assert row["gradient_bytes"] == blocks
        assert row["weights_bytes"] > row["gradient_bytes"]  # and the rotary buffer
        assert row["optimizer_bytes"] >= 2 * blocks  # exp_avg and exp_avg_sq (and steps)
        assert row["activation_bytes"] > 0 and row["fits"]
    assert rows["memory"]["peak_bytes"] <= rows["none"]["peak_bytes"]


def test_help_lists_the_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "h100-80gb" in out and "--optimizer" in out and torch.__version__
