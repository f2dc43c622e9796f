"""The compiled backend of the decode engine: one C++ kernel call per layer and single-token step, for every bucket.

`csrc/decode_attention.cpp` does, for every bucket of a `CompressedState` in one call, what `Bucket.attend` does per
bucket with about a dozen torch ops at a single-token step (append the new key / value, offset attention, the
certificate's rows a = (1 - pi) p^2 and sum_tail a v) and fills the same work buffers, so the statistics and the
oracle after the forward are the same code for both backends. `DecodeOptions.backend="auto"` picks it on a float32
CPU cache when it builds (`available()`), torch ops otherwise. The kernel is built on first use with torch's
cpp_extension (the machine's C++ compiler and ninja, about 30 s, cached under $TORCH_EXTENSIONS_DIR or
~/.cache/torch_extensions) for this CPU (-march=native: the cache name carries the CPU's model and flags, so a
shared home on a mixed cluster builds one copy per CPU type).
"""

from __future__ import annotations

import hashlib
import platform
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
FIX = "install a C++ compiler (g++) and `pip install ninja`, or set decode.backend=torch"


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


@cache
def kernel():
    """The compiled extension (built once per machine and source); one clear error when it cannot be built."""
    from torch.utils.cpp_extension import load

    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + " ".join(CFLAGS).encode() + _cpu_signature().encode()).hexdigest()[:12]
    try:
        return load(
            name=f"kvcert_decode_attention_{tag}",
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a failed build: say which and how to go on
        lines = str(err).strip().splitlines()
        reason = next((ln.strip() for ln in lines if " error: " in ln), lines[-1] if lines else type(err).__name__)
        raise RuntimeError(f"the compiled decode backend could not build its C++ kernel ({reason}): {FIX}") from err


@cache
def available() -> str | None:
    """None when the kernel builds here (or was built), else the one-line reason it cannot."""
    try:
        kernel()
    except RuntimeError as err:
        return str(err)
    return None


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    buckets: list,
    layer: int,
    scale: float,
    variance: list[bool],
) -> torch.Tensor:
    """One layer's single-token decode step for every bucket: query (B, Hkv, g, d), key / value (B, Hkv, d), the
    rows of the buckets in order, float32 and contiguous; variance: per bucket, whether to fill the certificate's
    rows. Returns o_hat (B, Hkv, g, d) and leaves each bucket's work buffers and cache lengths as `Bucket.attend`
    would."""
    bufs = [b.layers[layer] for b in buckets]
    n_kv, g, d = query.shape[1:]
    rows, outs = [], []
    for b, buf in zip(buckets, bufs):
        grp, local = b.where[layer]
        work_rows, work_out = grp.work(local, n_kv, g, d, buf.capacity, buf.offset)
        rows.append(work_rows)
        outs.append(work_out)
    none = query.new_empty(0)
    result = torch.empty_like(query)
    kernel().decode_attention(
        query,
        key,
        value,
        [buf.keys for buf in bufs],
        [buf.values for buf in bufs],
        [buf.offset for buf in bufs],
        [buf.one_minus_pi for buf in bufs],
        rows,
        outs,
        [none if buf.oracle_keys is None else buf.oracle_keys for buf in bufs],
        [none if buf.oracle_values is None else buf.oracle_values for buf in bufs],
        [buf.length for buf in bufs],
        [buf.tail_slots for buf in bufs],
        [buf.oracle_length for buf in bufs],
        [int(v) for v in variance],
        float(scale),
        result,
    )
    for buf in bufs:
        buf.length += 1
        if buf.oracle_keys is not None:
            buf.oracle_length += 1
    return result
