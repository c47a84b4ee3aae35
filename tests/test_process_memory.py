import sys

import pytest
import torch

from farsight.eval.efficiency import measure_peak_memory, run_isolated
from farsight.process_memory import TUNE_MALLOC_ENV, current_rss_bytes, peak_rss_bytes, reset_peak_rss, tune_malloc

MB = 2**20


def _allocate_and_free(megabytes: int) -> None:
    block = torch.ones(megabytes * MB // 4)  # touched, so resident
    del block


def test_peak_is_at_least_current():
    current = current_rss_bytes()  # read first: the RSS may grow before the peak is read
    assert peak_rss_bytes() >= current > 0


@pytest.mark.skipif(not reset_peak_rss(), reason="no resettable RSS high-water mark (not Linux)")
def test_peak_memory_of_a_repeated_call_is_measured_again():
    # A warm-up call reaches the same peak first, as in the benchmarks: the second measurement
    # must still see the whole allocation, not only what exceeds the first call's peak.
    first = measure_peak_memory(lambda: _allocate_and_free(64))
    second = measure_peak_memory(lambda: _allocate_and_free(64))
    assert first >= 60 * MB and second >= 60 * MB
    assert measure_peak_memory(lambda: None) < 16 * MB


def _page_faults_of_temporaries(case: dict) -> dict:
    """Subprocess body: minor page faults while case["count"] temporaries from case["mb"] MB up
    are written and freed.

    Each is a little larger than the last, so glibc's default (dynamic) mmap threshold, which
    rises to the size of the largest block freed, never catches up: every one is a fresh mmap.
    """
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(case["count"]):
        block = torch.ones((case["mb"] * MB + i * 64 * 1024) // 4)
        del block
    return {"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
@pytest.mark.parametrize(
    "case, default_faults, tuned_faults",
    [
        # 200 blocks of >= 1024 pages: at least 200K faults when each is mapped afresh; under
        # tune_malloc the heap keeps them, and only its growth to the largest block faults.
        ({"count": 200, "mb": 4}, 200_000, 20_000),
        # 40 blocks of 40-43 MB, above the largest mmap threshold glibc allows (32 MiB): mapped
        # afresh every time unless allocations never use mmap, as under tune_malloc (>= 400K
        # faults against the ~11K of growing the heap once to the largest block).
        ({"count": 40, "mb": 40}, 400_000, 40_000),
    ],
    ids=["4MB-blocks", "blocks-above-any-mmap-threshold"],
)
def test_tuned_malloc_reuses_freed_blocks_instead_of_faulting_them_in_again(case, default_faults, tuned_faults):
    tuned = run_isolated(_page_faults_of_temporaries, case)["faults"]
    default = run_isolated(_page_faults_of_temporaries, case, default_malloc=True)["faults"]
    assert default > default_faults and tuned < tuned_faults


def _tune_malloc_under(case: dict) -> dict:
    """Subprocess body (malloc settings are process-wide): tune_malloc with the opt-out variable set to case["env"]."""
    import os

    os.environ[TUNE_MALLOC_ENV] = case["env"]
    return {"applied": tune_malloc()}


def test_tune_malloc_can_be_turned_off():
    assert run_isolated(_tune_malloc_under, {"env": "1"}, default_malloc=True)["applied"] is False
    assert run_isolated(_tune_malloc_under, {"env": "0"}, default_malloc=True)["applied"] is sys.platform.startswith(
        "linux"
    )
