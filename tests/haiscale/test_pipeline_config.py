"""Pipeline pieces that need no processes: schedule names, the config, partitioning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fireflyer.haiscale.pipeline import (
    PipelineConfig,
    Schedule,
    make_subgroups,
    partition,
    split_sizes,
    stage_indices,
)


@pytest.mark.parametrize("name, expected", [
    ("GPipe", Schedule.GPIPE), ("gpipe", Schedule.GPIPE), ("1f1b", Schedule.ONE_F_ONE_B),
    ("PipeDream", Schedule.ONE_F_ONE_B), ("interleaved-1f1b", Schedule.INTERLEAVED_1F1B),
    ("Interleaved1F1B", Schedule.INTERLEAVED_1F1B), (Schedule.GPIPE, Schedule.GPIPE),
])
def test_schedule_names(name, expected):
    assert Schedule.parse(name) is expected


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="valid schedules: GPipe, 1F1B, Interleaved1F1B"):
        Schedule.parse("zero-bubble")
    with pytest.raises(TypeError):
        Schedule.parse(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid schedules"):
        PipelineConfig(n_microbatches=4, schedule="fifo")


def test_config_checks_itself():
    cfg = PipelineConfig(n_microbatches=8, schedule="gpipe")
    assert cfg.schedule is Schedule.GPIPE and cfg.scale_grads
    with pytest.raises(ValueError, match="at least 1"):
        PipelineConfig(n_microbatches=0)
    with pytest.raises(TypeError, match="must be an int"):
        PipelineConfig(n_microbatches=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PipelineConfig(8)  # type: ignore[misc]  # keyword-only


def test_theoretical_bubble():
    assert Schedule.GPIPE.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert Schedule.ONE_F_ONE_B.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert Schedule.INTERLEAVED_1F1B.bubble_fraction(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)


def test_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(4, 4) == [1, 1, 1, 1]
    assert split_sizes(5, 2, balance=[1, 4]) == [1, 4]
    with pytest.raises(ValueError, match="at least one layer"):
        split_sizes(3, 4)
    with pytest.raises(ValueError, match="summing to the model's 5 layers"):
        split_sizes(5, 2, balance=[2, 2])


def test_partition_shares_layers_and_covers_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(7)])
    stages = [partition(model, s, 3) for s in range(3)]
    assert [len(s) for s in stages] == [3, 2, 2]
    assert [layer for s in stages for layer in s] == list(model)
    x = torch.randn(2, 4)
    y = x
    for s in stages:
        y = s(y)
    torch.testing.assert_close(y, model(x))
    assert len(partition(nn.ModuleList(list(model)), 1, 2, balance=[5, 2])) == 2
    with pytest.raises(TypeError, match="nn.Sequential"):
        partition(nn.Linear(2, 2), 0, 1)
    with pytest.raises(ValueError, match="stage_index"):
        partition(model, 3, 3)


def test_stage_indices_loop_order():
    assert stage_indices(1, 4, 2) == [1, 5]
    assert stage_indices(0, 2) == [0]
    with pytest.raises(ValueError):
        stage_indices(4, 4)


def test_make_subgroups_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_subgroups(2)
