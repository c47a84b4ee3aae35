import pytest
import torch

from farsight.eval.efficiency import measure_peak_memory
from farsight.process_memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss

MB = 2**20


def _allocate_and_free(megabytes: int) -> None:
    block = torch.ones(megabytes * MB // 4)  # touched, so resident
    del block


def test_peak_is_at_least_current():
    assert peak_rss_bytes() >= current_rss_bytes() > 0


@pytest.mark.skipif(not reset_peak_rss(), reason="no resettable RSS high-water mark (not Linux)")
def test_peak_memory_of_a_repeated_call_is_measured_again():
    # A warm-up call reaches the same peak first, as in the benchmarks: the second measurement
    # must still see the whole allocation, not only what exceeds the first call's peak.
    first = measure_peak_memory(lambda: _allocate_and_free(64))
    second = measure_peak_memory(lambda: _allocate_and_free(64))
    assert first >= 60 * MB and second >= 60 * MB
    assert measure_peak_memory(lambda: None) < 16 * MB
