"""kvcert.hf.huge_pages: large decode buffers advised onto transparent huge pages, values untouched.

What kvcert does is tested everywhere: which range it advises (whole 2 MB pages inside the buffer, MADV_HUGEPAGE),
that small tensors are not advised, that `KVCERT_HUGE_PAGES=0` turns the advice off, and that the values are intact.
Whether the kernel then backs the range with huge pages is the kernel's decision, not kvcert's: that one check fails
only where an independent probe (a plain private `mmap` of the same size, advised and written, kvcert not involved)
gets huge pages when kvcert's buffer did not, and skips with both readings where the probe gets none either.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from kvcert.hf import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PROBE_BYTES = 8 << 20


def _thp_mode() -> str | None:
    """The kernel's THP mode (always, madvise, never), None where there is no THP."""
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _anon_huge_kb(start: int, nbytes: int) -> int | None:
    """kB on transparent huge pages in the mappings of this process that overlap [start, start + nbytes), from
    /proc/self/smaps; None where that file cannot be read."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's header: "lo-hi perms offset dev inode path"
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < start + nbytes and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _probe_huge_kb(nbytes: int) -> tuple[int | None, str]:
    """Probe, without kvcert: kB of huge pages the kernel gives an anonymous private mmap of `nbytes` (plus one huge
    page, for alignment) advised MADV_HUGEPAGE and written, and the THP mode; (None, why) where it cannot be asked."""
    mode = _thp_mode()
    if mode in (None, "never") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None, f"the kernel gives no transparent huge pages (THP mode {mode})"
    # private: a shared anonymous map is shmem, which has its own THP setting
    region = mmap.mmap(-1, nbytes + huge_pages.HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
        region.write(b"\1" * len(region))
        buf = ctypes.c_char.from_buffer(region)
        kb = _anon_huge_kb(ctypes.addressof(buf), len(region))
        del buf
    except OSError as err:
        return None, f"madvise(MADV_HUGEPAGE) refused by the kernel ({err})"
    finally:
        region.close()
    return kb, f"THP mode {mode}"


def _recording_madvise(monkeypatch, result: int = 0) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []

    def fake(addr: int, length: int, advice: int) -> int:
        calls.append((addr, length, advice))
        return result

    monkeypatch.setattr(huge_pages, "_madvise", lambda: fake)
    return calls


def test_the_advice_covers_the_whole_huge_pages_inside_the_buffer(monkeypatch):
    calls = _recording_madvise(monkeypatch)
    big = torch.empty(3 * huge_pages.HUGE_PAGE // 4 + 123)  # 3 huge pages' worth of float32, unaligned length
    assert huge_pages.advise_huge_pages(big) is True
    ((addr, length, advice),) = calls
    start = big.untyped_storage().data_ptr()
    end = start + big.untyped_storage().nbytes()
    assert advice == huge_pages.MADV_HUGEPAGE == 14
    assert addr % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0 and length > 0
    assert start <= addr < start + huge_pages.HUGE_PAGE  # the first whole huge page
    assert addr + length <= end < addr + length + huge_pages.HUGE_PAGE  # up to the last whole one
    calls.clear()
    assert huge_pages.advise_huge_pages(torch.empty(1000)) is False and calls == []  # below MIN_BYTES: no call


def test_a_refused_advice_returns_false_and_leaves_the_values(monkeypatch):
    _recording_madvise(monkeypatch, result=-1)
    src = torch.randn(huge_pages.MIN_BYTES // 4 + 7)
    out = huge_pages.empty_on_huge_pages(*src.shape, like=src)
    out.copy_(src)
    assert huge_pages.advise_huge_pages(out) is False and torch.equal(out, src)


def test_kvcert_huge_pages_0_turns_the_advice_off(monkeypatch):
    calls = _recording_madvise(monkeypatch)
    big = torch.empty(huge_pages.MIN_BYTES // 4 + 1)
    monkeypatch.setenv("KVCERT_HUGE_PAGES", "0")
    assert huge_pages.advise_huge_pages(big) is False and calls == []
    monkeypatch.setenv("KVCERT_HUGE_PAGES", "1")
    assert huge_pages.advise_huge_pages(big) is True and len(calls) == 1


def test_the_real_advice_is_a_bool_and_small_tensors_are_never_advised():
    assert huge_pages.advise_huge_pages(torch.empty(1000)) is False
    assert isinstance(huge_pages.advise_huge_pages(torch.empty(huge_pages.MIN_BYTES // 4 + 1)), bool)


def test_an_advised_buffer_holds_what_was_written():
    src = torch.randn(16 << 20)  # 64 MB
    out = huge_pages.empty_on_huge_pages(*src.shape, like=src)
    out.copy_(src)
    assert torch.equal(out, src)


def test_an_advised_buffer_is_backed_by_huge_pages_where_the_kernel_grants_them():
    """kvcert's 64 MB buffer, advised and written, holds at least 8 MB on huge pages, unless the kernel, asked the
    same right after through a plain advised mmap of the same size, grants fewer than that (memory too fragmented,
    THP off, a kernel that backs nothing): then the backing is the kernel's choice, and the test says what it saw."""
    src = torch.randn(16 << 20)  # 64 MB
    out = huge_pages.empty_on_huge_pages(*src.shape, like=src)
    out.copy_(src)
    kb = _anon_huge_kb(out.untyped_storage().data_ptr(), out.untyped_storage().nbytes())
    if kb is not None and kb >= 8 << 10:  # at least 8 MB of the 64 MB on huge pages (usually all of it)
        return
    probe_kb, mode = _probe_huge_kb(src.untyped_storage().nbytes())
    if probe_kb is None or probe_kb < 8 << 10:
        pytest.skip(
            f"the kernel granted {probe_kb} kB of huge pages to an advised, written 64 MB mmap, no kvcert ({mode}); "
            f"kvcert's buffer got {kb} kB: whether advised memory is backed is the kernel's choice"
        )
    raise AssertionError(f"kvcert's advised buffer got {kb} kB of huge pages, a plain advised mmap {probe_kb} kB")


def test_empty_on_huge_pages_has_the_asked_shape_dtype_and_device():
    like = torch.zeros(2, dtype=torch.float64)
    out = huge_pages.empty_on_huge_pages(3, 4, 5, like=like)
    assert out.shape == (3, 4, 5) and out.dtype == torch.float64 and out.device == like.device
    assert huge_pages.empty_on_huge_pages(2, like=like, dtype=torch.float32).dtype == torch.float32
