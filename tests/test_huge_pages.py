"""The gradient window of a large master asks for huge pages ([Note: huge pages for the
gradient window]): read back from the kernel's own view of this process's mappings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_yafsdp.core.optim import huge_pages
from lightning_yafsdp.core.optim.grads import ShardGrads
from lightning_yafsdp.core.optim.huge_pages import FRESH_MAPPING_BYTES, HUGE_PAGE_BYTES

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding ``address`` (``hg``: advised huge pages)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _window_of(numel: int) -> torch.Tensor:
    grads = ShardGrads(torch.zeros(numel), params=[])
    grads.begin_backward()  # no grads live: a fresh window
    return grads._fresh


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not THP.exists()
    or "THP_MEM_ALLOC_ENABLE" in os.environ,
    reason="Linux with THP, and torch not advising every large allocation itself",
)
def test_a_window_of_32_mib_or_more_asks_the_kernel_for_huge_pages():
    window = _window_of(FRESH_MAPPING_BYTES // 4 + HUGE_PAGE_BYTES)
    inside = -(-window.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    assert "hg" in _vm_flags(inside)
    window.fill_(1.5)  # faulted in as usual, values as written
    assert window.sum().item() == 1.5 * window.numel()


def test_a_smaller_window_is_left_to_glibc(monkeypatch):
    advised = []
    monkeypatch.setattr(huge_pages, "advise_huge_pages", lambda *args: advised.append(args))
    _window_of(256 * 1024)  # 1 MiB: glibc's heap serves it again without faults
    assert advised == []
    _window_of(FRESH_MAPPING_BYTES // 4)
    assert len(advised) == 1


def test_no_whole_huge_page_inside_the_range_means_no_advice():
    assert not huge_pages.advise_huge_pages(HUGE_PAGE_BYTES + 4096, HUGE_PAGE_BYTES)
