"""Build the compiled decode kernel when kvcert is installed (the rest of the metadata is pyproject.toml).

The extension `kvcert.hf._decode_attention` is compiled by `kvcert.hf.kernel.build_prebuilt` -- torch's cpp_extension,
the same command as the kernel's just-in-time build -- so torch must be importable here: build without isolation
(`make install` does `pip install --no-build-isolation --no-deps -e .`; a wheel: `pip wheel --no-build-isolation
--no-deps .`). Without torch or a C++ compiler, or with KVCERT_BUILD_KERNEL=0, the install goes on without it (a note
on stderr) and kvcert builds the kernel at first use instead. The binary is built with -march=native for the CPU that
installs; `_decode_attention.json` beside it records what it was built for, and kvcert uses it only on a match.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
KERNEL = ROOT / "src" / "kvcert" / "hf" / "kernel.py"
NAME = "_decode_attention"  # kvcert.hf._decode_attention (kernel.PREBUILT)
RECORD = f"{NAME}.json"  # beside it: what it was built for (kernel.build_record)


class _Skipped(Exception):
    """The kernel is not built at install; kvcert builds it at first use."""


def _kernel_module():
    """kvcert/hf/kernel.py loaded by path (it imports only the standard library and torch): one source of truth for
    the flags and the build record."""
    if os.environ.get("KVCERT_BUILD_KERNEL", "1").strip().lower() in {"0", "false", "no", "off"}:
        raise _Skipped("KVCERT_BUILD_KERNEL=0")
    if importlib.util.find_spec("torch") is None:
        raise _Skipped("torch is not importable here (an isolated build? use pip's --no-build-isolation)")
    spec = importlib.util.spec_from_file_location("_kvcert_kernel_build", KERNEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernel(build_ext):
    """build_ext whose one extension is built by torch's cpp_extension; skipped (with a note) when it cannot be."""

    def run(self) -> None:
        inplace = self.inplace
        try:
            self._kernel = _kernel_module()
            super().run()  # build_extension below; then, for an editable install, copied into src/
            return
        except _Skipped as why:
            reason = str(why)
        self.inplace = inplace  # setuptools' run leaves it False when a build raises
        self.extensions = []  # nothing to copy or to list as an output
        note = f"kvcert: the decode kernel was not built at install ({reason}); it is built at first use"
        print(note, file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        try:
            self._kernel.build_prebuilt(target)
        except Exception as err:  # no compiler, no ninja, a failed build: the install goes on without it
            lines = str(err).strip().splitlines()
            raise _Skipped(f"the build failed: {lines[-1] if lines else type(err).__name__}") from err
        print(f"kvcert: built the decode kernel {target.name}", file=sys.stderr)

    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        for built, inplace in self.get_output_mapping().items():  # the build record goes where the binary went
            if Path(built).name == RECORD:
                self.copy_file(built, inplace, level=self.verbose)

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()  # inplace: the keys of get_output_mapping, which name the record
        return outputs if self.inplace else outputs + [_record(out) for out in outputs if _is_kernel(out)]

    def get_output_mapping(self) -> dict[str, str]:
        mapping = super().get_output_mapping()
        return {**mapping, **{_record(b): _record(i) for b, i in mapping.items() if _is_kernel(b)}}


def _is_kernel(path: str) -> bool:
    return Path(path).name.startswith(f"{NAME}.") and Path(path).name != RECORD


def _record(path: str) -> str:
    return str(Path(path).with_name(RECORD))


setup(
    ext_modules=[Extension(f"kvcert.hf.{NAME}", sources=["src/kvcert/hf/csrc/decode_attention.cpp"])],
    cmdclass={"build_ext": BuildKernel},
)
