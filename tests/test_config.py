"""torch_tdist.config: a group's settings from its backend options and the environment."""

import pytest

from torch_tdist.config import OVERLAPS, Config

CHOICES = {"transport": ("auto", "shm", "cuda"), "algorithm": ("auto", "oneshot", "twoshot"),
           "overlap": OVERLAPS, "bulk_push": ("copy_engine", "sm"), "streamed_min_block_bytes": (16, 16384)}


def test_options_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("TDIST_OVERLAP", "fused")
    monkeypatch.setenv("TDIST_HEAP_SIZE", "2G")
    config = Config.from_options({"overlap": "pipelined"}, choices=CHOICES)
    assert config.overlap == "pipelined"  # the option
    assert config.heap_bytes == 2 << 30  # the variable, where no option is given


def test_measurement_settings_are_options_only(monkeypatch):
    monkeypatch.setenv("TDIST_GPU_SIZE_LIMITS", "0")  # no longer read
    assert Config.from_options(None, choices=CHOICES).gpu_size_limits is True
    config = Config.from_options({"gpu_size_limits": False, "streamed_step_blocks": 3, "bulk_push": "sm"},
                                 choices=CHOICES)
    assert (config.gpu_size_limits, config.streamed_step_blocks, config.bulk_push) == (False, 3, "sm")


@pytest.mark.parametrize("options", [{"TDIST_OVERLAP": "pipelined"}, {"heapsize": "1G"}])
def test_an_unknown_option_is_refused(options):
    with pytest.raises(ValueError, match=f"unknown backend option.*{next(iter(options))}"):
        Config.from_options(options, choices=CHOICES)


def test_a_bad_value_names_where_it_came_from(monkeypatch):
    monkeypatch.setenv("TDIST_ALGORITHM", "fastest")
    with pytest.raises(ValueError, match="TDIST_ALGORITHM"):
        Config.from_options(None, choices=CHOICES)
    monkeypatch.delenv("TDIST_ALGORITHM")
    with pytest.raises(ValueError, match="streamed_step_blocks"):
        Config.from_options({"streamed_step_blocks": 0}, choices=CHOICES)


def test_no_communication_runs_the_ops_sequentially(monkeypatch):
    monkeypatch.setenv("TDIST_OVERLAP", "pipelined")
    config = Config.from_options({"communication": False}, choices=CHOICES)
    assert (config.communication, config.overlap) == (False, "sequential")
    assert Config.from_options(None, choices=CHOICES).communication is True
    with pytest.raises(ValueError, match="communication"):
        Config.from_options({"communication": "sometimes"}, choices=CHOICES)
