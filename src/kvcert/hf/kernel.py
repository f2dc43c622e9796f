"""The compiled backend of the decode engine: one C++ kernel call per layer and single-token step, for every bucket.

`csrc/decode_attention.cpp` does, for every bucket of a `CompressedState` in one call, what `Bucket.attend` does per
bucket with about a dozen torch ops at a single-token step (append the new key / value, offset attention, the
certificate's rows a = (1 - pi) p^2 and sum_tail a v) and fills the same work buffers, so the statistics and the
oracle after the forward are the same code for both backends. `DecodeOptions.backend="auto"` picks it on a float32
CPU cache when it builds (`available()`), torch ops otherwise.

Where the compiled kernel comes from, in order (`kernel()`):
1. Built at install: setup.py's build_ext (`make install`, `pip install --no-build-isolation .`, a wheel from
   `pip wheel --no-build-isolation --no-deps .`; torch must be importable, so not under build isolation) calls
   `build_prebuilt`, which compiles with torch's cpp_extension `load` -- the JIT build's very command, the module's
   name aside -- into the package as `kvcert/hf/_decode_attention<EXT_SUFFIX>`, and records beside it
   (`_decode_attention.json`) what the binary depends on (`build_record`): the source's sha256, the flags, the CPU's
   model and flags (-march=native makes it CPU-specific), the torch version and the Python extension suffix. It is
   imported only when that record's tag (`build_tag`) is this machine's. Without torch or a compiler at install, or
   with KVCERT_BUILD_KERNEL=0, the install skips it with a note.
2. Otherwise (another CPU or torch, a changed source, no prebuilt): built just in time, once per tag (about 35 s),
   into `<$TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/kvcert_decode_attention_<tag>/` (a folder named by the
   tag alone: a shared home on a mixed cluster builds one copy per CPU type); a marker written after the build lets
   every later process import that binary directly, without running ninja. Going through ninja each time rebuilt
   whenever another ninja came first on PATH (a system 1.11 and the venv's 1.13 write build logs of different
   versions, and each discards the other's log as too old or too new: 40 s per switch).
The source and the flags (CFLAGS, LDFLAGS) fix the float rounding of published records: change neither lightly.
This module imports only the standard library and torch, because setup.py loads it by path at build time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sysconfig
import tempfile
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
PREBUILT = "_decode_attention"  # kvcert.hf._decode_attention, built at install (setup.py)
PREBUILT_RECORD = Path(__file__).with_name(f"{PREBUILT}.json")
MARKER = "kvcert-built.json"  # in a JIT build folder, written after a successful build
FIX = "install a C++ compiler (g++) and `pip install ninja`, or set decode.backend=torch"


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def build_record() -> dict[str, str]:
    """What a compiled kernel depends on: the same record means the same binary can be used."""
    cpu = _cpu_signature()
    return {
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "cflags": " ".join(CFLAGS),
        "ldflags": " ".join(LDFLAGS),
        "cpu_model": next((ln.split(":", 1)[-1].strip() for ln in cpu.splitlines() if ln.startswith("model")), cpu),
        "cpu_sha256": hashlib.sha256(cpu.encode()).hexdigest(),  # the model and flags lines: -march=native
        "torch": torch.__version__,
        "python": str(sysconfig.get_config_var("EXT_SUFFIX")),
    }


def build_tag(record: dict[str, str] | None = None) -> str:
    """The short name of a build: a hash of `build_record`."""
    text = json.dumps(record or build_record(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # whole or absent: a reader never sees half a record


def _load_library(name: str, library: Path) -> ModuleType | None:
    """Import a compiled extension from its file (no build); None when it is absent or does not load."""
    spec = importlib.util.spec_from_file_location(name, library) if library.is_file() else None
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None  # a damaged or foreign binary: build one
    return module


def _recorded_tag(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("tag")
    except (OSError, ValueError, AttributeError):
        return None


def _prebuilt(tag: str) -> ModuleType | None:
    """The extension built at install, when its record is this machine's and this source's; else None."""
    if _recorded_tag(PREBUILT_RECORD) != tag:
        return None
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return _load_library(f"kvcert.hf.{PREBUILT}", PREBUILT_RECORD.with_name(f"{PREBUILT}{suffix}"))


def _jit_folder(tag: str) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"kvcert_decode_attention_{tag}"


def _import_built(folder: Path, name: str, tag: str) -> ModuleType | None:
    """A JIT build finished earlier (its marker names this tag), imported without running ninja; else None."""
    return _load_library(name, folder / f"{name}.so") if _recorded_tag(folder / MARKER) == tag else None


def _compile(name: str, folder: Path) -> ModuleType:
    """torch's cpp_extension build: the one compile command for the prebuilt and the JIT kernel (name aside)."""
    from torch.utils.cpp_extension import load

    folder.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(folder),
        verbose=False,
    )


def build_prebuilt(target: Path) -> Path:
    """Compile the kernel into `target` (the package's `_decode_attention<EXT_SUFFIX>`; setup.py's build_ext) and
    write its record beside it; returns the record's path."""
    record = build_record()
    with tempfile.TemporaryDirectory(prefix="kvcert-kernel-") as tmp:
        _compile(PREBUILT, Path(tmp))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / f"{PREBUILT}.so", target)
    out = target.with_name(f"{PREBUILT}.json")
    _write_json(out, {**record, "tag": build_tag(record)})
    return out


@cache
def kernel() -> ModuleType:
    """The compiled extension: the one built at install when it fits, else built once per tag (see the module
    docstring); one clear error when it cannot be built."""
    record = build_record()
    tag = build_tag(record)
    module = _prebuilt(tag)
    if module is not None:
        return module
    name, folder = f"kvcert_decode_attention_{tag}", _jit_folder(tag)
    module = _import_built(folder, name, tag)
    if module is not None:
        return module
    try:
        module = _compile(name, folder)
    except Exception as err:  # no compiler, no ninja, a failed build: say which and how to go on
        lines = str(err).strip().splitlines()
        reason = next((ln.strip() for ln in lines if " error: " in ln), lines[-1] if lines else type(err).__name__)
        raise RuntimeError(f"the compiled decode backend could not build its C++ kernel ({reason}): {FIX}") from err
    _write_json(folder / MARKER, {**record, "tag": tag})
    return module


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
