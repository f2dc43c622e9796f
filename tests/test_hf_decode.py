"""The decoder: a variant's tokens and statistics do not depend on its batch (other variants, rows leaving the
batch, the backend) beyond float rounding; stop strings."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcert.hf.compressed_batch as compressed_batch_module
from conftest import needs_cxx
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.hf.compressed_state import CompressedState
from kvcert.hf.decode import StopDetector, answer_length
from kvcert.policy import FULL, Policy

N, QS = 160, 130


class _CharTokenizer:
    """Token i is chr(i): a stop string of c characters spans c tokens."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


POLICIES = (
    [FULL]
    + [
        Policy(scorer=s, design=d, budget=b, seed=1)
        for s in ("window_question", "window_context", "streaming", "key_norm")
        for d in ("topk", "randomized")
        for b in (0.3, 0.6)
    ]
    + [Policy(scorer="streaming", design="randomized", budget=0.5, compress_after="context")]
)


def _assert_same(ref, new, atol=1e-5):
    for a, b in zip(ref, new):
        assert a.policy == b.policy
        assert (a.n_answer, a.answer) == (b.n_answer, b.answer), a.policy.label
        assert a.tokens[: a.n_answer + 1] == b.tokens[: b.n_answer + 1]
        assert np.allclose(a.logprobs[: a.n_answer + 1], b.logprobs[: b.n_answer + 1], atol=atol)
        assert a.stats.keys() == b.stats.keys()
        for name in a.stats:
            assert a.stats[name].shape == b.stats[name].shape, (a.policy.label, name)
            assert np.array_equal(np.isnan(a.stats[name]), np.isnan(b.stats[name])), (a.policy.label, name)
            assert np.allclose(a.stats[name], b.stats[name], atol=atol, equal_nan=True), (a.policy.label, name)


def test_a_variant_decodes_the_same_alone_and_in_the_batch(tiny_smol):
    """Tokens, answers and answer lengths identical; statistics to 1e-5 absolute (the matmuls see other batch shapes,
    and the oracle's softmax is split at another point). Rows leave the batch at different steps (stop string)."""
    model, tok = tiny_smol
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    stops = (tok.decode([ids[7]]),)  # a frequent-enough token text so that rows finish at different steps
    opts = DecodeOptions(max_new_tokens=8, stop_strings=stops, backend="torch")
    together = generate_variants(model, tok, prompt, POLICIES, opts)
    assert len({r.n_answer for r in together}) > 1, "pick another stop string: rows must finish at different steps"
    alone = [generate_variants(model, tok, prompt, [p], opts)[0] for p in POLICIES]
    _assert_same(alone, together)


def test_finished_rows_leave_the_batch(tiny_smol, monkeypatch):
    import kvcert.hf.decode as decode

    model, _ = tiny_smol
    tok = _CharTokenizer()
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    policies = [FULL] + [
        Policy(scorer="streaming", design="topk", budget=b, compress_after="context") for b in (0.1, 0.2, 0.4)
    ]
    first = generate_variants(model, tok, prompt, policies, DecodeOptions(max_new_tokens=1))
    assert first[0].tokens[0] not in {r.tokens[0] for r in first[1:]}, "pick another seed: a row must go on"
    batch_sizes = []
    forward = decode.forward_with_state

    def spy(model, input_ids, position, state):
        batch_sizes.append(input_ids.shape[0])
        return forward(model, input_ids, position, state)

    monkeypatch.setattr(decode, "forward_with_state", spy)
    stop = chr(first[0].tokens[0])  # the full cache's first token ends its answer at once
    res = generate_variants(model, tok, prompt, policies, DecodeOptions(max_new_tokens=4, stop_strings=(stop,)))
    assert res[0].n_answer == 0 and res[0].answer == ""
    assert batch_sizes and max(batch_sizes) < len(policies)  # the full-cache row never took a decode step
    monkeypatch.setattr(decode, "forward_with_state", forward)
    opts = DecodeOptions(max_new_tokens=4, stop_strings=(stop,))
    alone = [generate_variants(model, tok, prompt, [p], opts)[0] for p in policies]
    assert [r.answer for r in res] == [r.answer for r in alone]


def test_stop_detector_sees_a_stop_string_spanning_tokens():
    tok = _CharTokenizer()
    stop = StopDetector(tok, ("<end>",))
    assert not stop([ord(c) for c in "abc<en"])
    assert stop([ord(c) for c in "abc<end>"])
    assert stop([ord(c) for c in "x" * 100 + "<end>"])  # only the last 4c+4 tokens are decoded
    assert not StopDetector(tok, ())([ord("a")])


def test_answer_length_cuts_at_eos_and_stop_strings():
    tok = _CharTokenizer()
    ids = [ord(c) for c in "42. more"]
    assert answer_length(tok, ids, {0}, (".",)) == (2, "42")
    assert answer_length(tok, [ord("7"), 0, ord("9")], {0}, ()) == (1, "7")
    assert answer_length(None, [5, 6, 0], {0}, ()) == (2, "5 6")


def test_tight_radius_every_refreshes_tr_c2_and_carries_its_ratio_between(tiny_smol):
    """tight_radius_every=3: at steps 0, 3, 6 tr(C^2) equals the every-step value bit for bit; between, tr(C^2) /
    V_hat^2 is the last refresh's (the effective dimension is carried, V_hat is not); every other statistic is
    untouched; rows leaving the batch keep their own carried ratio."""
    model, tok = tiny_smol
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    stops = (tok.decode([ids[7]]),)
    policies = [FULL] + [
        Policy(scorer=s, design="randomized", budget=b, seed=1)
        for s in ("window_question", "streaming")
        for b in (0.3, 0.6)
    ]
    base = DecodeOptions(max_new_tokens=8, stop_strings=stops)
    ref = generate_variants(model, tok, prompt, policies, base)
    new = generate_variants(
        model, tok, prompt, policies, DecodeOptions(max_new_tokens=8, stop_strings=stops, tight_radius_every=3)
    )
    carried = 0
    for a, b in zip(ref, new):
        assert (a.tokens, a.n_answer) == (b.tokens, b.n_answer)
        for name in a.stats:
            if name != "trace_c2":
                assert np.array_equal(a.stats[name], b.stats[name], equal_nan=True), name
        if a.policy.design != "randomized":
            continue
        var, tc_ref, tc_new = a.stats["variance"], a.stats["trace_c2"], b.stats["trace_c2"]
        for step in range(len(var)):
            if step % 3 == 0:
                assert np.array_equal(tc_ref[step], tc_new[step], equal_nan=True)
                psi = tc_ref[step] / var[step] ** 2
            else:
                ok = var[step] > 0
                assert np.allclose(tc_new[step][ok] / var[step][ok] ** 2, psi[ok], rtol=1e-4)
                carried += int(ok.sum())
    assert carried > 0
    with pytest.raises(ValueError, match="tight_radius_every"):
        DecodeOptions(tight_radius_every=0)


@needs_cxx
@pytest.mark.parametrize("every", [1, 3])
def test_the_compiled_backend_changes_nothing_but_float_rounding(tiny_smol, monkeypatch, every):
    """decode.backend=compiled against torch ops: every statistic of every step (certificate, diagnostics, tr(C^2)
    refreshed or carried, oracle error) to float rounding, tokens and answers exactly, with rows leaving the batch
    and two compression times (two oracle prefixes); one kernel call per layer and step for all buckets, and one
    statistics pass per layer group and bucket after the forward."""
    from kvcert.hf import kernel as kernel_module
    from kvcert.hf.layer_buffers import LayerGroup

    model, tok = tiny_smol
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    stops = (tok.decode([ids[7]]),)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=b, seed=1)
        for s in ("window_question", "streaming")
        for d in ("topk", "randomized")
        for b in (0.3, 0.6)
    ]
    policies += [  # a second compression time: a second oracle prefix, buckets grouped by it
        Policy(scorer="streaming", design=d, budget=0.5, compress_after="context") for d in ("topk", "randomized")
    ]
    ref = generate_variants(
        model,
        tok,
        prompt,
        policies,
        DecodeOptions(max_new_tokens=8, stop_strings=stops, tight_radius_every=every, backend="torch"),
    )
    flushes, kernel_calls = [], []
    flush, kernel = LayerGroup.flush, kernel_module.decode_attention

    def flush_spy(self, *args, **kwargs):
        flushes.append(len(self.layers))
        return flush(self, *args, **kwargs)

    def kernel_spy(*args, **kwargs):
        kernel_calls.append(len(args[3]))  # buckets in the call
        return kernel(*args, **kwargs)

    monkeypatch.setattr(LayerGroup, "flush", flush_spy)
    monkeypatch.setattr(kernel_module, "decode_attention", kernel_spy)
    new = generate_variants(
        model,
        tok,
        prompt,
        policies,
        DecodeOptions(max_new_tokens=8, stop_strings=stops, tight_radius_every=every, backend="compiled"),
    )
    n_layers = model.config.num_hidden_layers
    assert flushes and set(flushes) == {n_layers}, "one pass over all layers of a group"
    assert kernel_calls and max(kernel_calls) > 1, "one kernel call for all buckets"
    assert any(r.n_answer < 8 for r in ref), "pick another stop string: some row must leave the batch"
    for a, b in zip(ref, new):
        assert (a.tokens[: a.n_answer + 1], a.n_answer, a.answer) == (b.tokens[: b.n_answer + 1], b.n_answer, b.answer)
        assert a.stats.keys() == b.stats.keys() and "trace_c2" in a.stats and "error" in a.stats
        for name in a.stats:
            assert a.stats[name].shape == b.stats[name].shape, (a.policy.label, name)
            assert np.array_equal(np.isnan(a.stats[name]), np.isnan(b.stats[name])), (a.policy.label, name)
            assert np.allclose(a.stats[name], b.stats[name], rtol=1e-5, atol=1e-7, equal_nan=True), (
                a.policy.label,
                name,
            )


def test_take_tokens_is_the_gather_it_replaces():
    """The buffers' row copy equals core.hajek.gather_tokens exactly, per head and for repeated indices."""
    from kvcert.core.hajek import gather_tokens
    from kvcert.hf.compressed_batch import _take_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 8, generator=g)
    idx = torch.randint(0, 50, (3, 17), generator=g)
    idx[1, :3] = 49  # repeats and the last token
    assert torch.equal(_take_tokens(x, idx), gather_tokens(x, idx))
    assert torch.equal(_take_tokens(x, idx[:, :0]), gather_tokens(x, idx[:, :0]))


class _HostReads(TorchDispatchMode):
    """Counts what would make the host wait for a GPU: reading a tensor's values (.tolist, .item, .cpu, bool / int /
    float of a tensor) and the ops whose output size depends on values (nonzero, boolean-mask indexing, ...)."""

    OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique", "_unique2"}

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        for name in ("tolist", "cpu"):
            method = getattr(torch.Tensor, name)

            def counted(t, *args, _method=method, **kwargs):
                self.count += 1
                with self.paused():
                    return _method(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        self.on = False

    def paused(self):
        from contextlib import contextmanager

        @contextmanager
        def off():
            was, self.on = self.on, False
            try:
                yield
            finally:
                self.on = was

        return off()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func._schema.name.split("::")[-1] in self.OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("oracle", [True, False])
def test_the_decoder_reads_the_device_once_per_step(tiny_smol, monkeypatch, oracle):
    """Ready for a GPU: no host read inside the forward (the layer loop), one per decode step (the new tokens and
    their log-probabilities, for the end-of-answer checks), one before the loop and one after it (the statistics),
    including the steps where finished rows leave the batch."""
    import kvcert.hf.decode as decode

    model, _ = tiny_smol
    tok = _CharTokenizer()
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    policies = [FULL] + [
        Policy(scorer="streaming", design=d, budget=b, seed=1, compress_after="context")
        for d, b in (("topk", 0.1), ("randomized", 0.2), ("randomized", 0.4))
    ]  # 1 of 4 rows finished: the batch is compacted
    first = generate_variants(model, tok, prompt, policies, DecodeOptions(max_new_tokens=1))
    assert first[0].tokens[0] not in {r.tokens[0] for r in first[1:]}, "pick another seed: a row must go on"
    stops = (chr(first[0].tokens[0]),)  # the full cache's row ends at once, the others go on
    opts = DecodeOptions(max_new_tokens=8, stop_strings=stops, oracle=oracle, backend="torch")
    reads = _HostReads(monkeypatch)
    forward, decode_batch = decode.forward_with_state, decode.decode_batch
    in_forward, steps, sizes = [], [], []

    def forward_spy(*args, **kwargs):
        before = reads.count
        sizes.append(args[1].shape[0])
        out = forward(*args, **kwargs)
        in_forward.append(reads.count - before)
        steps.append(1)
        return out

    def decode_spy(*args, **kwargs):
        reads.count, reads.on = 0, True
        try:
            return decode_batch(*args, **kwargs)
        finally:
            reads.on = False

    kept = []
    keep_rows = CompressedState.keep_rows

    def keep_spy(self, rows):
        kept.append(rows)
        return keep_rows(self, rows)

    monkeypatch.setattr(CompressedState, "keep_rows", keep_spy)
    monkeypatch.setattr(decode, "forward_with_state", forward_spy)
    monkeypatch.setattr(compressed_batch_module, "decode_batch", decode_spy)
    with reads:
        res = generate_variants(model, tok, prompt, policies, opts)
    assert kept and sizes[0] < len(policies), "rows must leave the batch during the decode"
    assert in_forward == [0] * len(steps)
    assert reads.count <= len(steps) + 2, (reads.count, len(steps))
    assert res[0].n_answer == 0 and all(r.stats for r in res[1:])
