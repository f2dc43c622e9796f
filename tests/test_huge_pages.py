"""kvcert.hf.huge_pages: large decode buffers advised onto transparent huge pages, values untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcert.bench.read import huge_page_mb
from kvcert.hf import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's THP mode (always, madvise, never), None where there is no THP."""
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def test_small_tensors_are_not_advised_and_large_ones_are_where_the_kernel_has_thp():
    assert huge_pages.advise_huge_pages(torch.empty(1000)) is False  # below MIN_BYTES: no system call
    big = torch.empty(huge_pages.MIN_BYTES // 4 + 1)
    assert huge_pages.advise_huge_pages(big) is (_thp_mode() is not None)


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="the kernel gives no transparent huge pages")
def test_an_advised_buffer_is_backed_by_huge_pages_once_written_and_holds_what_was_written():
    before = huge_page_mb()
    src = torch.randn(16 << 20)  # 64 MB
    out = huge_pages.empty_on_huge_pages(*src.shape, like=src)
    out.copy_(src)
    assert torch.equal(out, src)
    assert huge_page_mb() - before >= 8  # at least 8 MB of the 64 MB on huge pages (usually all of it)


def test_empty_on_huge_pages_has_the_asked_shape_dtype_and_device():
    like = torch.zeros(2, dtype=torch.float64)
    out = huge_pages.empty_on_huge_pages(3, 4, 5, like=like)
    assert out.shape == (3, 4, 5) and out.dtype == torch.float64 and out.device == like.device
    assert huge_pages.empty_on_huge_pages(2, like=like, dtype=torch.float32).dtype == torch.float32


def test_kvcert_huge_pages_0_turns_the_advice_off(monkeypatch):
    big = torch.empty(huge_pages.MIN_BYTES // 4 + 1)
    monkeypatch.setenv("KVCERT_HUGE_PAGES", "0")
    assert huge_pages.advise_huge_pages(big) is False
    monkeypatch.setenv("KVCERT_HUGE_PAGES", "1")
    assert huge_pages.advise_huge_pages(big) is (_thp_mode() is not None)
