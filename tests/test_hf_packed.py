"""decode.packed_weights (kvcert/hf/packed.py): MKL's packed GEMM in place of every float32 CPU linear layer, equal to
F.linear, restored after the block, and a warning (not a failure) where torch has no MKL."""

from __future__ import annotations

import logging

import torch
from torch import nn

from conftest import needs_mkl
from kvcert.hf import packed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Linear(48, 8, bias=False), nn.Linear(8, 8).double())


@needs_mkl
def test_packed_linears_equal_f_linear_and_are_restored(monkeypatch):
    m = _model()
    x = torch.randn(7, 3, 16)  # 21 rows
    calls = []
    mkl_linear = packed._mkl_linear
    monkeypatch.setattr(packed, "_mkl_linear", lambda flat, *a: calls.append(flat.shape[0]) or mkl_linear(flat, *a))
    with torch.no_grad():
        ref = m[:3](x)
        with packed.packed_linears(m, rows=21):
            assert [hasattr(layer, "_kvcert_packed") for layer in m] == [True, False, True, False], "float32 only"
            out = m[:3](x)
            padded = m[:3](x[:5])  # fewer rows than packed for: zero-padded up to them
            solo = m[:3](x[:1])  # under half of them: F.linear
    assert calls == [21, 21, 21, 21], "21 rows, then 15 padded to 21; 3 rows (under half) take F.linear"
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded, ref[:5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(solo, ref[:1], rtol=1e-6, atol=1e-6)
    assert not any("forward" in vars(layer) or hasattr(layer, "_kvcert_packed") for layer in m)
    assert packed.packed_weights(m, 21) is packed.packed_weights(m, 21), "built once per row count"


def test_without_mkl_the_switch_warns_and_does_nothing(monkeypatch, caplog):
    monkeypatch.setattr(packed, "available", lambda: False)
    m = _model()
    with caplog.at_level(logging.WARNING, logger="kvcert.hf.packed"), packed.packed_linears(m, rows=4):
        assert not any("forward" in vars(layer) for layer in m)
    assert "no MKL packed GEMM" in caplog.text
