"""`DecodeOptions.packed_weights`: the model's float32 linear layers through MKL's pre-packed sgemm on CPU.

At decode time every linear layer multiplies a few rows (one per variant) by a weight matrix that is read from
memory again at every step; MKL's packed GEMM (`torch.ops.mkl._mkl_linear`, what torch.compile's CPU backend uses
for frozen linear layers) skips the per-call packing of that matrix: 1.36x at 24 rows for 60 cold 576 x 1536
matrices on this machine, but only at exactly the row count it was packed for. The weights are packed once per
model for the batch's row count (0.3 s for SmolLM2-135M; kept on the model, as much memory again as its linear
weights); decode steps with fewer rows (finished variants left the batch) are zero-padded up to it while at least
half remain, and other forwards (fewer rows, or more: prefill, the question forward) use F.linear. On a torch
build without MKL the switch does nothing (one warning).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger(__name__)
_CACHE = "_kvcert_packed_linears"  # model attribute: (row hint, {module name: packed weight})


def available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return type(module) is nn.Linear and w is not None and w.dtype == torch.float32 and w.device.type == "cpu"


def packed_weights(model: nn.Module, rows: int) -> dict[str, torch.Tensor]:
    """Every packable linear layer's weight in MKL's packed layout for about `rows` rows; built once per hint."""
    hint, packed = getattr(model, _CACHE, (None, None))
    if hint != rows:
        with torch.no_grad():
            packed = {
                name: torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), rows)
                for name, m in model.named_modules()
                if _packable(m)
            }
        object.__setattr__(model, _CACHE, (rows, packed))  # a plain attribute: not a parameter, not in state_dict
    return packed


def _mkl_linear(x, packed, weight, bias, rows):
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """MKL's packed GEMM for up to `rows` rows: it runs its packed kernel only at exactly the row count it was
    packed for (other counts fall back to a plain GEMM inside the op), so fewer rows are zero-padded up to it (each
    output row depends on its own input row only) while at least half of them remain; fewer rows, or more (prefill,
    the question forward), take F.linear."""
    rows = self._kvcert_rows
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    # below half the rows the padded rows cost more than packing saves (1 of 24 rows: 2x slower than F.linear)
    if not rows >= n >= rows / 2 or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return nn.functional.linear(x, self.weight, self.bias)
    if n < rows:
        flat = torch.cat([flat, flat.new_zeros(rows - n, flat.shape[1])])
    out = _mkl_linear(flat, self._kvcert_packed, self.weight, self.bias, rows)
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


@contextmanager
def packed_linears(model: nn.Module, rows: int, enabled: bool = True) -> Iterator[nn.Module]:
    """Inside the block, the model's float32 CPU linear layers run MKL's packed GEMM; restored after."""
    if not enabled:
        yield model
        return
    if not available():
        log.warning("decode.packed_weights: this torch build has no MKL packed GEMM; the switch does nothing")
        yield model
        return
    packed = packed_weights(model, rows)
    swapped = []
    try:
        for name, m in model.named_modules():
            if name in packed:
                m._kvcert_packed, m._kvcert_rows = packed[name], rows
                m.forward = types.MethodType(_packed_forward, m)
                swapped.append(m)
        yield model
    finally:
        for m in swapped:
            del m.forward, m._kvcert_packed, m._kvcert_rows
