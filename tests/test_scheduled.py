"""``analysis.scheduled``: the peak of a compiled graph from its buffer timeline, counted per
storage above what existed before the step."""

from __future__ import annotations

from memfit.analysis.scheduled import Schedule, scheduled_peak


def test_buffers_live_from_their_kernel_until_after_their_last_reader() -> None:
    timeline = [
        ("buf0", False, 100, 100, 0, 1),  # freed after step 1
        ("buf1", False, 50, 50, 1, 2),
        ("buf2", False, 30, 30, 2, -1),  # a graph output: never freed
    ]
    # step 0: 100; step 1: 150; step 2: buf0 gone, 50 + 30
    assert scheduled_peak(timeline, lambda name: []) == 150


def test_inputs_count_once_per_storage_and_parameters_not_at_all() -> None:
    timeline = [
        ("saved_view_a", True, 40, 40, 0, 0),
        ("saved_view_b", True, 40, 40, 0, 3),
        ("weight", True, 1000, 1000, 0, 3),
        ("buf0", False, 10, 10, 1, 3),
    ]
    storages = {"saved_view_a": [("s", 64)], "saved_view_b": [("s", 64)], "weight": []}
    # one storage of 64 bytes alive until step 3, plus buf0 from step 1
    assert scheduled_peak(timeline, storages.__getitem__) == 74
    assert scheduled_peak(timeline, storages.__getitem__, held_bytes=6) == 80


def test_unknown_inputs_count_at_inductors_size() -> None:
    timeline = [("tangents_9", True, 24, 24, 0, 0), ("buf0", False, 8, 8, 1, 1)]
    assert scheduled_peak(timeline, {}.__getitem__) == 24


def test_output_bytes_names_the_buffers_the_graph_allocated() -> None:
    schedule = Schedule(
        buffers=(("primals_1", True, 8, 8, 0, 0), ("buf3", False, 16, 16, 0, -1)),
        outputs=("buf3", "buf3", "primals_1"),
    )
    assert schedule.output_bytes(["buf3", "primals_1"]) == {"buf3": 16}
