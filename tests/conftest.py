"""Shared test set-up: every test starts with Dynamo's caches empty.

Dynamo keeps compiled code per code object across the whole process, with a limit on how many
versions it keeps; tests wrap many models of the same classes in many modes, so without a reset
a later test could silently run an earlier test's graphs or hit the recompile limit.

Run by ``pytest -n N`` (pytest-xdist, as ``make test`` does), each of the N worker processes
gets its share of the machine's cores for torch's threads, so the workers do not contend for them.

``split_graphs`` records the forward and backward graphs memfit's backend makes of each plan;
``backward_donations`` the donated inputs of each backward graph Inductor compiles.
"""

import os
from typing import Any, NamedTuple

import pytest
import torch
import torch.fx as fx


def conv_bn_net() -> torch.nn.Module:
    """Two seeded Conv-BatchNorm-ReLU layers and a Linear head, for inputs of 2x3x8x8: the
    smallest model with training BatchNorms between convolutions."""
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


#: Marks a test (or a ``pytest.param``) that needs a GPU: skipped where CUDA is not available.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch.compiler.reset()


# ---- the fast tier: `make test-fast` runs what is not marked slow (`make test` runs everything)
#: Where a test runs over many models, these three stay in the fast tier: a chain of linears, a
#: ResNet with BatchNorm, a transformer encoder (attention).
CORE_MODELS = ("mlp", "resnet", "transformer")
#: Models a parametrized test names in its id that only the full suite runs.
_SLOW_MODELS = {
    "unet", "lstm", "densenet", "dropout", "inplace_relu", "shared", "structured", "gpt2",
    "resnet110", "bert", "llama", "t5",
}  # fmt: skip
#: Whole files the fast tier leaves out: subprocesses and several ranks (the command line,
#: pipelines, import order), Inductor compiles and passes, every zoo model under budgets, the
#: frameworks, the benchmarks' runner.
_SLOW_FILES = {
    "test_budget_zoo.py", "test_executors.py", "test_fusion.py", "test_examples.py",
    "test_pipeline_runtime.py", "test_launch.py", "test_ddp.py", "test_huggingface.py",
    "test_benchmarks_depth_sweep.py", "test_cli_profile.py", "test_cli_errors.py",
    "test_cli_out.py", "test_cli_demo.py", "test_cli_pipeline.py", "test_cli_bench.py",
    "test_cli_batch_search.py", "test_passes.py", "test_runner.py",
}  # fmt: skip


#: Single tests the fast tier leaves out: the slowest on 2 cores (1.9-8 s each, measured with
#: ``--durations`` when the fast tier passed 2 minutes), each still run by ``make test``.
_SLOW_TESTS = {
    "test_accumulate.py::test_a_step_accumulates_too_and_zeroed_grads_are_added_into",
    "test_accumulate.py::test_accumulating_micro_batches_hold_what_plain_holds[memory]",
    "test_accumulate.py::test_accumulating_micro_batches_hold_what_plain_holds[none]",
    "test_accumulate.py::test_leaves_are_checked_by_the_backwards_own_edges_not_a_view_each",
    "test_benchmarks_same_peak_pair.py::test_a_bare_side_steps_memfits_compiled_program_without_its_call_around_it",
    "test_benchmarks_same_peak_pair.py::test_an_undonated_side_compiles_a_backward_that_reuses_no_saved_value",
    "test_capture_attention.py::test_a_rewritten_attention_serves_every_sequence_length",
    "test_capture_attention.py::test_huggingface_output_attentions_is_left_alone",
    "test_run_chain.py::test_a_backward_that_keeps_the_graph_replays_again",
    "test_run_chain.py::test_a_byte_budget_holds_for_a_step_whose_runs_are_dropped",
    "test_run_chain.py::test_a_replay_draws_the_random_numbers_its_forward_drew",
    "test_run_chain.py::test_a_value_changed_in_place_after_the_forward_is_refused_as_plain_pytorch_refuses",
    "test_run_chain.py::test_losses_gradients_statistics_and_dropout_masks_equal_plain_pytorch",
    "test_run_chain.py::test_micro_batches_accumulate_as_in_plain_pytorch",
    "test_graph_breaks.py::test_graph_break_trains_exactly_and_warns_once_with_location",
    "test_module.py::test_a_model_setting_problem_type_on_its_first_call_is_captured_once",
    "test_module.py::test_matches_plain_pytorch[resnet-budget-min-cpu]",
    "test_module.py::test_matches_plain_pytorch[transformer-budget-min-cpu]",
    "test_offload.py::test_budget_with_offload_reaches_below_recompute_only",
    "test_offload.py::test_zoo_swap_is_bit_identical_to_keeping_everything[resnet]",
    "test_plan_pipeline.py::test_a_budget_is_met_by_every_stage_or_refused_with_the_least_that_fits",
    "test_plan_pipeline.py::test_a_plan_has_k_contiguous_stages_covering_the_graph_and_prints_a_table",
    "test_plan_pipeline.py::test_in_flight_micro_batches_follow_the_schedule",
    "test_plan_pipeline.py::test_schedules_with_several_stages_per_rank_cut_that_many_stages_and_place_them",
    "test_pipeline_cut_search.py::test_a_span_the_planner_refuses_is_cut_around",
    "test_pipeline_cut_search.py::test_too_many_refusals_end_the_search",
    "test_pipeline_stage_planner.py::test_one_stage_per_rank_keeps_the_cheapest_point_that_fits",
    "test_planned_call.py::test_a_budget_with_the_loss_outside_on_cpu_is_measured_and_held",
    "test_planned_call.py::test_a_budget_with_the_loss_outside_under_a_users_profiler_says_so_and_measures_later",
    "test_planned_call.py::test_measure_outside_false_keeps_the_first_plan",
    "test_planned_call.py::test_replan_pending_says_the_next_call_plans_again",
    "test_planning_offload.py::test_budget_below_the_floor_fits_only_with_offload",
    "test_policies.py::test_memory_peaks_at_most_as_high_as_per_block_checkpointing",
    "test_policies.py::test_none_peaks_as_eager_on_the_zoo[transformer]",
    "test_policies.py::test_speed_mode_keeps_heavy_outputs_and_saves_memory",
    "test_policies.py::test_tanh_chain_memory_is_sqrt_n[100]",
    "test_refine.py::test_never_worse_and_closed_under_saved_needed",
    "test_regions.py::test_plan_shows_the_regions_without_training",
    "test_regions.py::test_regions_train_exactly_like_plain_pytorch",
    "test_regions.py::test_warning_says_what_memfit_did_and_where",
    "test_segments.py::test_cuts_are_at_small_frontiers",
    "test_split.py::test_symbolically_sized_view_of_an_input_stays_saved",
    "test_step.py::test_a_step_around_a_loss_predicts_its_peak_to_the_byte[mse]",
    "test_step.py::test_a_step_predicts_its_whole_peak_and_keeps_plain_gradients[budget]",
    "test_step.py::test_a_step_predicts_its_whole_peak_and_keeps_plain_gradients[memory]",
    "test_step.py::test_a_step_predicts_its_whole_peak_and_keeps_plain_gradients[none]",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark slow: the files above, a parametrized case that names a model outside the core trio,
    a test of the Inductor executor, and the single tests named above (tests marked ``slow`` by
    hand are the rest: the slowest single tests, 2-12 s each on 2 cores)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        ids = set(callspec.id.split("-")) if callspec is not None else set()
        inductor = "inductor" in ids or "inductor" in getattr(item, "originalname", item.name)
        named = f"{item.path.name}::{item.name}" in _SLOW_TESTS
        if item.path.name in _SLOW_FILES or ids & _SLOW_MODELS or inductor or named:
            item.add_marker(pytest.mark.slow)


class Split(NamedTuple):
    """One call of ``split_joint_graph`` made by memfit's backend: what went in, what came out."""

    joint: fx.GraphModule
    plan: Any
    kwargs: dict[str, Any]
    fw: fx.GraphModule
    bw: fx.GraphModule


@pytest.fixture
def split_graphs(monkeypatch: pytest.MonkeyPatch) -> list[Split]:
    """Every forward and backward graph memfit's backend splits a joint graph into during the
    test, in order, with the plan it followed."""
    from memfit.execution import partitioner

    seen: list[Split] = []
    original = partitioner.split_joint_graph

    def spy(joint: fx.GraphModule, plan: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        fw, bw = original(joint, plan, **kwargs)
        seen.append(Split(joint, plan, kwargs, fw, bw))
        return fw, bw

    monkeypatch.setattr(partitioner, "split_joint_graph", spy)
    return seen


@pytest.fixture
def backward_donations(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The positions given to Inductor as donated for each backward graph it compiles for memfit
    during the test, in order."""
    from memfit.execution import executors

    donated: list[list[int]] = []
    original = executors.inductor_compile

    def spy(gm: fx.GraphModule, examples: Any, **kwargs: Any) -> Any:
        if kwargs["is_backward"]:
            donated.append(list(kwargs["donated_inputs"]))
        return original(gm, examples, **kwargs)

    monkeypatch.setattr(executors, "inductor_compile", spy)
    return donated
