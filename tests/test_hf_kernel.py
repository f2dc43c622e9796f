"""The compiled backend of the decode engine (decode.backend=compiled, kvcert/hf/kernel.py) against an exact float64
computation of what it must produce, -inf padding inside the filled length included (the build uses -ffast-math),
and its errors. End to end (every statistic equal to the torch-ops backend's): tests/test_hf_decode.py."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import needs_cxx
from kvcert.hf import kernel as fused


def _bucket(gen, rows, n_kv, d, capacity, length, tail_slots, oracle_capacity=0):
    """Random buffers in the fast path's layout: keys (B, Hkv, d, capacity); offset -log pi on the tail, 0 on the
    head, -inf on padding beyond `length`."""
    keys = torch.randn(rows, n_kv, d, capacity, generator=gen)
    values = torch.randn(rows, n_kv, capacity, d, generator=gen)
    pi = torch.rand(rows, n_kv, tail_slots, generator=gen) * 0.9 + 0.05
    offset = torch.zeros(rows, n_kv, capacity)
    offset[..., :tail_slots] = -pi.log()
    offset[..., length:] = float("-inf")
    if rows > 1:  # a narrower row of the bucket: padding (-inf) inside the filled length, before the head's end
        offset[1, :, tail_slots + 1 : length - 2] = float("-inf")
    own = torch.zeros(rows, n_kv, oracle_capacity, d), torch.zeros(rows, n_kv, oracle_capacity, d)
    return dict(keys=keys, values=values, offset=offset, omp=1 - pi, length=length, s=tail_slots, own=own)


def _reference(q, new_k, new_v, b, scale):
    """float64: the cache after appending, p, a = (1 - pi) p^2, o_hat, sum a v and V_hat by its definition."""
    hi = b["length"] + 1
    kt = b["keys"].double().clone()
    v = b["values"].double().clone()
    off = b["offset"].double().clone()
    kt[..., b["length"]], v[:, :, b["length"]], off[..., b["length"]] = new_k.double(), new_v.double(), 0.0
    p = torch.softmax(q.double() @ kt[..., :hi] * scale + off[:, :, None, :hi], -1)
    s = b["s"]
    a = b["omp"].double()[:, :, None, :] * p[..., :s] ** 2
    o = p @ v[:, :, :hi]
    av = a @ v[:, :, :s]
    dev = v[:, :, None, :s, :] - o[:, :, :, None, :]  # (B, Hkv, g, s, d)
    variance = (a * dev.square().sum(-1)).sum(-1)
    return p, a, o, av, variance


@needs_cxx
@pytest.mark.parametrize("group, d", [(3, 64), (2, 16), (8, 24), (7, 64), (7, 16)])
def test_kernel_matches_exact_attention_and_certificate(group, d):
    """Two buckets of different widths, one with the certificate's rows and an oracle part, one without: the cache
    append, p, a, o_hat, sum a v and V_hat (from the work buffers, as flush_stats computes it) equal a float64
    computation to float32 rounding."""
    gen = torch.Generator().manual_seed(group * 100 + d)
    n_kv, scale = 2, d**-0.5
    buckets = [
        _bucket(gen, 3, n_kv, d, capacity=40, length=33, tail_slots=20, oracle_capacity=6),
        _bucket(gen, 2, n_kv, d, capacity=17, length=11, tail_slots=5),
    ]
    variance = [True, False]
    bsz = 5
    q = torch.randn(bsz, n_kv, group, d, generator=gen)
    new_k, new_v = torch.randn(bsz, n_kv, d, generator=gen), torch.randn(bsz, n_kv, d, generator=gen)
    refs, starts = [], [0, 3, 5]
    for i, b in enumerate(buckets):
        rows = slice(starts[i], starts[i + 1])
        refs.append(_reference(q[rows], new_k[rows], new_v[rows], b, scale))
    work = [torch.zeros(starts[i + 1] - starts[i], n_kv, 3 * group, b["keys"].shape[-1]) for i, b in enumerate(buckets)]
    outs = [torch.full((starts[i + 1] - starts[i], n_kv, 2 * group, d), torch.nan) for i in range(2)]
    result = torch.empty_like(q)
    fused.kernel().decode_attention(
        q, new_k, new_v,
        [b["keys"] for b in buckets], [b["values"] for b in buckets], [b["offset"] for b in buckets],
        [b["omp"] for b in buckets], work, outs,
        [buckets[0]["own"][0], torch.empty(0)], [buckets[0]["own"][1], torch.empty(0)],
        [b["length"] for b in buckets], [b["s"] for b in buckets], [2, 0], [int(v) for v in variance],
        scale, result,
    )  # fmt: skip
    for i, (b, (p, a, o, av, var)) in enumerate(zip(buckets, refs)):
        rows, hi, s, g = slice(starts[i], starts[i + 1]), b["length"] + 1, b["s"], group
        assert torch.equal(b["keys"][..., hi - 1], new_k[rows]) and torch.equal(b["values"][:, :, hi - 1], new_v[rows])
        assert (b["offset"][..., hi - 1] == 0).all()
        torch.testing.assert_close(work[i][:, :, :g, :hi].double(), p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs[i][:, :, :g].double(), o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result[rows].double(), o, rtol=1e-5, atol=1e-5)
        if variance[i]:
            torch.testing.assert_close(work[i][:, :, g : 2 * g, :s].double(), a, rtol=1e-5, atol=1e-7)
            assert (work[i][:, :, g : 2 * g, s:] == 0).all(), "a stays zero beyond the tail"
            torch.testing.assert_close(outs[i][:, :, g:].double(), av, rtol=1e-4, atol=1e-6)
            # V_hat = sum a ||v||^2 - 2 o . (sum a v) + ||o||^2 sum a, as flush_stats forms it from the buffers
            v_sq = b["values"][:, :, :s].square().sum(-1)
            a32, o32, av32 = work[i][:, :, g : 2 * g, :s], outs[i][:, :, :g], outs[i][:, :, g:]
            v_hat = (a32 * v_sq[:, :, None]).sum(-1) - 2 * (o32 * av32).sum(-1) + o32.square().sum(-1) * a32.sum(-1)
            torch.testing.assert_close(v_hat.double(), var, rtol=1e-4, atol=1e-6)
        else:
            assert torch.isnan(outs[i][:, :, g:]).all(), "no certificate rows: the kernel leaves them alone"
    own_k, own_v = buckets[0]["own"]
    assert torch.equal(own_k[:, :, 2], new_k[:3]) and torch.equal(own_v[:, :, 2], new_v[:3])
    assert (own_k[:, :, [0, 1, 3]] == 0).all(), "the oracle part is written at its length only"


@needs_cxx
def test_kernel_refuses_a_full_buffer():
    gen = torch.Generator().manual_seed(0)
    b = _bucket(gen, 1, 1, 8, capacity=4, length=4, tail_slots=2)
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="KV buffer is full"):
        fused.kernel().decode_attention(
            q, k, k, [b["keys"]], [b["values"]], [b["offset"]], [b["omp"]], [torch.zeros(1, 1, 6, 4)],
            [torch.zeros(1, 1, 4, 8)], [torch.empty(0)], [torch.empty(0)], [4], [2], [0], [1], 0.3, torch.empty_like(q),
        )  # fmt: skip


def test_a_kernel_that_cannot_build_says_how_to_go_on(tmp_path, monkeypatch):
    bad = tmp_path / "decode_attention.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(fused, "SOURCE", bad)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))  # the failed build's folder stays out of ~/.cache
    fused.kernel.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"could not build its C\+\+ kernel .*decode.backend=torch"):
            fused.kernel()
    finally:
        fused.kernel.cache_clear()


def test_backend_option_is_checked():
    from kvcert.hf import DecodeOptions

    with pytest.raises(ValueError, match="backend='fused'; choose one of auto, torch, compiled"):
        DecodeOptions(backend="fused")


@needs_cxx
@pytest.mark.parametrize("arch", ["llama", "qwen2.5"])
def test_both_backends_decode_the_same_tokens_and_statistics(arch):
    """The compiled kernel and torch ops fill the same work buffers; the statistics after the forward are one code
    path. Tokens identical, every statistic equal to float rounding."""
    from kvcert.hf import DecodeOptions, Prompt, generate_variants, tiny_random_model
    from kvcert.policy import FULL, Policy

    model, _ = tiny_random_model(arch)
    ids = torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt = Prompt(input_ids=ids, question_start=280, example_id="ex")
    policies = [FULL] + [
        Policy(scorer=sc, design=de, budget=b, seed=1)
        for sc in ("window_question", "window_context")
        for de in ("topk", "randomized")
        for b in (0.25, 0.5)
    ]
    runs = {b: generate_variants(model, None, prompt, policies, DecodeOptions(max_new_tokens=5, backend=b))
            for b in ("torch", "compiled")}  # fmt: skip
    for a, b in zip(runs["torch"], runs["compiled"]):
        assert a.tokens == b.tokens, a.policy.label
        for name, arr in a.stats.items():
            torch.testing.assert_close(
                torch.from_numpy(b.stats[name]), torch.from_numpy(arr), rtol=1e-4, atol=1e-6, equal_nan=True
            )


def test_auto_falls_back_to_torch_with_one_line_when_the_kernel_cannot_build(monkeypatch, capsys):
    from kvcert.hf import compressed_batch
    from kvcert.testing import tiny_random_model

    model, _ = tiny_random_model("llama")
    monkeypatch.setattr(fused, "available", lambda: "no compiler here")
    compressed_batch._announce.cache_clear()
    like = torch.zeros(1)
    assert compressed_batch.resolve_backend("auto", like, model.config) == "torch"
    assert "decode backend: torch (no compiler here)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="decode.backend=compiled cannot run: no compiler here"):
        compressed_batch.resolve_backend("compiled", like, model.config)
    compressed_batch._announce.cache_clear()


# ------------------------------------------------------------------------------ where the compiled kernel comes from
@pytest.fixture
def fresh_kernel():
    """kernel() looks again (it caches its module per process)."""
    fused.kernel.cache_clear()
    yield
    fused.kernel.cache_clear()


def _refuse_builds(monkeypatch) -> None:
    import torch.utils.cpp_extension as cpp

    def refuse(*args, **kwargs):
        raise AssertionError("kernel() built the extension")

    monkeypatch.setattr(cpp, "load", refuse)


def test_the_flags_of_the_published_records_are_kept():
    """CFLAGS and the source fix the float rounding of the published records; the install build and the JIT build
    both take them from kernel.py."""
    assert fused.CFLAGS == ("-O3", "-march=native", "-ffast-math", "-fopenmp") and fused.LDFLAGS == ("-fopenmp",)
    record = fused.build_record()
    assert record["cflags"] == "-O3 -march=native -ffast-math -fopenmp" and record["torch"] == torch.__version__
    assert fused.build_tag(record) == fused.build_tag() and len(fused.build_tag()) == 16
    assert fused.build_tag({**record, "cpu_sha256": "0" * 64}) != fused.build_tag(), "another CPU: another build"


@needs_cxx
def test_the_kernel_built_at_install_is_imported_not_built(tmp_path, monkeypatch, fresh_kernel):
    """With the extension built at install for this machine (setup.py -> build_prebuilt; `make install` puts it in
    src/kvcert/hf/), kernel() builds nothing: no cpp_extension.load, no JIT folder."""
    record = fused.PREBUILT_RECORD
    if fused._recorded_tag(record) != fused.build_tag():  # not built at install here: build one the same way
        record = fused.build_prebuilt(tmp_path / "pkg" / f"{fused.PREBUILT}{sysconfig.get_config_var('EXT_SUFFIX')}")
    monkeypatch.setattr(fused, "PREBUILT_RECORD", record)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))
    _refuse_builds(monkeypatch)
    module = fused.kernel()
    assert Path(module.__file__).parent == record.parent and Path(module.__file__).name.startswith("_decode_attention.")
    assert not (tmp_path / "jit").exists()
    test_kernel_matches_exact_attention_and_certificate(3, 64)  # the same numbers through the prebuilt binary


def test_a_prebuilt_kernel_for_another_machine_falls_back_to_one_jit_build(tmp_path, monkeypatch, fresh_kernel):
    """A record for another CPU (or torch, or source) is not used: kernel() builds just in time, into a folder named
    by the tag alone, with the same flags, and marks it built."""
    import torch.utils.cpp_extension as cpp

    other = {**fused.build_record(), "cpu_sha256": "0" * 64}
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / f"{fused.PREBUILT}.json").write_text(json.dumps({**other, "tag": fused.build_tag(other)}))
    (pkg / f"{fused.PREBUILT}{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"built for another CPU")
    monkeypatch.setattr(fused, "PREBUILT_RECORD", pkg / f"{fused.PREBUILT}.json")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))
    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kwargs: calls.append(kwargs) or "the JIT module")
    assert fused.kernel() == "the JIT module"
    tag = fused.build_tag()
    folder = tmp_path / "jit" / f"kvcert_decode_attention_{tag}"
    assert [(c["name"], c["build_directory"]) for c in calls] == [(f"kvcert_decode_attention_{tag}", str(folder))]
    assert calls[0]["extra_cflags"] == list(fused.CFLAGS) and calls[0]["extra_ldflags"] == list(fused.LDFLAGS)
    assert json.loads((folder / fused.MARKER).read_text())["tag"] == tag


@needs_cxx
def test_a_finished_jit_build_is_imported_whichever_ninja_comes_first(tmp_path, monkeypatch, fresh_kernel):
    """Once built, the JIT kernel is imported from its folder without running ninja: a system ninja 1.11 and the
    venv's 1.13 discarded each other's build log (log versions), and each rebuilt for 40 s."""
    monkeypatch.setattr(fused, "PREBUILT_RECORD", tmp_path / "no-install-build.json")
    first = fused.kernel()  # built once per tag (or imported: built before)
    fused.kernel.cache_clear()
    _refuse_builds(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja and no compiler at all
    assert fused.kernel().__file__ == first.__file__
