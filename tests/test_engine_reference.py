"""The decode engine against an independent float64 reference, on real decode steps of a tiny random model.

What the engine used at every single-token step (query, kept keys / values, offsets -log pi, 1 - pi) is captured by
spying on the bucket's attention step (`Bucket.attend`, on the torch-ops backend) and on the compression
(`compress`, looked up in kvcert.hf.prefill); nothing under src/ is changed. Every statistic the engine records is
then recomputed here in float64 from those inputs with a few lines of plain torch (no kvcert function):

- the inputs themselves: kept keys / values are the true prompt cache (a plain transformers forward with its own
  DynamicCache) at the compressed positions, offsets are -log pi on the tail, 0 on the head and appended tokens,
  -inf on padding, and the appended layer-0 keys are the true keys of the generated tokens (RoPE at the real
  positions);
- o_hat = softmax(q K^T * scale + offset) V, V_hat = sum_tail (1 - pi) p^2 ||v - o_hat||^2, the diagnostics of
  core/certificate.py (tail mass, Kish ESS, tail size, largest tail weight, head mass, p_max, ||o_hat||), the
  sketched debiased tr(C^2) from its definition (C_S = R^T C_hat R with R ~ N(0, 1) (d, 8) from seed 0), the
  oracle error ||o_hat - softmax(q K_full^T * scale) V_full|| over the full prompt plus the variant's own appended
  tokens, the radii z95 sqrt(V_hat) and sqrt(g chi2.ppf(0.95, h)) (scipy), and the trust flag;
- then the step records (records.step_frame) and one examples row (records.example_frame) by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps
from transformers import DynamicCache

from kvcert import records
from kvcert.bench.common import no_eos
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.hf import compressed_state as compressed_state_module
from kvcert.hf import prefill as prefill_module
from kvcert.policy import FULL, Policy
from kvcert.tasks.ruler import Example
from kvcert.testing import tiny_random_model

N, QS, STEPS = 400, 380, 4  # prompt, question start (a 20-token question), decode steps
SEED = 1
RANDOMIZED = {b: Policy(scorer="window_question", design="randomized", budget=b, seed=SEED) for b in (0.25, 0.5)}
TOPK = Policy(scorer="window_question", design="topk", budget=0.25)
SMALL = Policy(scorer="window_question", design="randomized", budget=0.1, seed=SEED)  # ~10 tail tokens: ESS ~ 10
POLICIES = [FULL, RANDOMIZED[0.25], RANDOMIZED[0.5], TOPK, SMALL]
Z95 = 1.959963984540054  # scipy.stats.norm.ppf(0.975)
SKETCH_K, SKETCH_SEED = 8, 0  # the documented sketch: d x 8, iid N(0, 1) drawn in float64 from seed 0
# the trust flag's documented thresholds (core/certificate.py)
ESS_MIN, TAIL_MASS_MIN, ESS_RATIO_MIN = 10.0, 1e-2, 0.3


# ---------------------------------------------------------------------------------------------- the engine run
@pytest.fixture(scope="module", params=["llama", "qwen2.5"])
def run(request):
    """One generate_variants call with certificate and oracle on; per (policy, step, layer) what hajek_attention
    received and returned, the Compressed of every policy, the results, and a plain transformers reference."""
    model, _ = tiny_random_model(request.param)  # qwen2.5: 7 query heads per KV head, q/k/v biases
    ids = torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="ex-0")
    calls, comps, batches = [], {}, []

    real_attend = compressed_state_module.Bucket.attend
    real_compress = prefill_module.compress
    real_batch = prefill_module.Prefill.compress

    def attend_spy(self, layer, query, key, value, scale, **kwargs):
        out = real_attend(self, layer, query, key, value, scale, **kwargs)
        # only single-token decode steps with statistics are the engine's certificate / oracle steps
        if query.shape[-2] == 1 and kwargs.get("stats", False):
            buf = self.layers[layer]
            bsz, n_q, _, d = query.shape
            n_kv = key.shape[1]
            certified = kwargs["certificate"] and self.certified and buf.compressed
            calls.append(
                {
                    "bucket": self,
                    "layer": layer,
                    "position": self.position,
                    "prefix": buf.prefix,
                    "query": query.reshape(bsz, n_kv, n_q // n_kv, d).double().clone(),
                    "keys": buf.key_slots(buf.length).double().clone(),
                    "values": buf.values[:, :, : buf.length].double().clone(),
                    "offset": buf.offset[:, :, : buf.length].double().clone(),
                    "one_minus_pi": buf.one_minus_pi.double().clone() if certified else None,
                    "variance_slots": buf.tail_slots,
                    "scale": scale,
                    "mask": None,
                    "output": out.reshape(bsz, n_kv, n_q // n_kv, d).double().clone(),
                }
            )
        return out

    def compress_spy(policy, *args, **kwargs):
        comps[policy.label] = out = real_compress(policy, *args, **kwargs)
        return out

    def batch_spy(self, policies, options):
        batch = real_batch(self, policies, options)
        batches.append(batch)
        return batch

    with pytest.MonkeyPatch.context() as mp, no_eos(model):
        mp.setattr(compressed_state_module.Bucket, "attend", attend_spy)
        mp.setattr(prefill_module, "compress", compress_spy)
        mp.setattr(prefill_module.Prefill, "compress", batch_spy)
        # certificate, oracle and tr(C^2) at every step (defaults); torch ops, so that Bucket.attend runs per bucket
        options = DecodeOptions(max_new_tokens=STEPS, backend="torch")
        assert options.certificate and options.oracle and options.tight_radius and options.tight_radius_every == 1
        results = generate_variants(model, None, prompt, POLICIES, options)

    # which policy is which row of which bucket
    (batch,) = batches
    rows_of, start = {}, 0
    for bucket in batch.state.buckets:
        rows_of[id(bucket)] = batch.rows[start : start + bucket.batch_size]
        start += bucket.batch_size
    steps = {}  # (policy index, step, layer) -> per-row inputs of that call
    for c in calls:
        for row, pol in enumerate(rows_of[id(c["bucket"])]):
            key = (pol, c["position"] - N, c["layer"])
            assert key not in steps, key
            steps[key] = {
                "query": c["query"][row],  # (Hkv, group, d)
                "keys": c["keys"][row],  # (Hkv, L, d)
                "values": c["values"][row],
                "offset": c["offset"][row],  # (Hkv, L)
                "one_minus_pi": None if c["one_minus_pi"] is None else c["one_minus_pi"][row],  # (Hkv, s)
                "tail_slots": c["variance_slots"],
                "prefix": c["prefix"],
                "scale": c["scale"],
                "mask": c["mask"],
                "output": c["output"][row],
            }
    n_layers = model.config.num_hidden_layers
    every = {(p, s, layer) for p in range(len(POLICIES)) for s in range(STEPS) for layer in range(n_layers)}
    assert set(steps) == every, "one captured call per policy, decode step and layer"

    # the reference cache: plain transformers (SDPA, its own DynamicCache), float32 -> float64
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([ids]), cache=cache, use_cache=True)
        prompt_keys = [cache.layers[layer].keys[0].double() for layer in range(n_layers)]  # (Hkv, N, d)
        prompt_values = [cache.layers[layer].values[0].double() for layer in range(n_layers)]
        appended_k0 = {}  # policy -> layer-0 keys of the tokens it generated, (Hkv, STEPS, d)
        for p, r in enumerate(results):
            full = DynamicCache(config=model.config)
            model(torch.tensor([ids + r.tokens[:STEPS]]), cache=full, use_cache=True)
            appended_k0[p] = full.layers[0].keys[0, :, N:].double()
    return {
        "arch": request.param,
        "model": model,
        "ids": ids,
        "results": results,
        "steps": steps,
        "comps": comps,
        "prompt_keys": prompt_keys,
        "prompt_values": prompt_values,
        "appended_k0": appended_k0,
        "n_layers": n_layers,
    }


# ------------------------------------------------------------------------------------------ float64 reference
def _sketch(d: int) -> torch.Tensor:
    return torch.randn(d, SKETCH_K, generator=torch.Generator().manual_seed(SKETCH_SEED), dtype=torch.float64)


def reference_step(x: dict, prompt_keys: torch.Tensor, prompt_values: torch.Tensor) -> dict[str, np.ndarray]:
    """Every recorded statistic of one (policy, step, layer), per query head (Hq,), in float64, from the engine's
    inputs by the definitions (hajek.py, certificate.py and sketch.py docstrings)."""
    q, k, v, off = x["query"], x["keys"], x["values"], x["offset"]
    n_kv, g, d = q.shape
    prefix = x["prefix"]
    s = x["tail_slots"] or 0
    omp = x["one_minus_pi"]
    certified = omp is not None
    r = _sketch(d)
    out = {name: np.full(n_kv * g, np.nan) for name in records.STEP_COLUMNS}
    for kv in range(n_kv):
        # the oracle: the full prompt then the variant's own appended tokens (the slots after its prefix)
        k_full = torch.cat([prompt_keys[kv], k[kv, prefix:]])
        v_full = torch.cat([prompt_values[kv], v[kv, prefix:]])
        tail = torch.zeros(k.shape[1], dtype=torch.bool)
        if certified:
            tail[:s] = omp[kv, :s] > 0
        for gi in range(g):
            h = kv * g + gi
            p = torch.softmax(q[kv, gi] @ k[kv].T * x["scale"] + off[kv], -1)
            o = p @ v[kv]
            exact = torch.softmax(q[kv, gi] @ k_full.T * x["scale"], -1) @ v_full
            out["error"][h] = float((o - exact).norm())
            out["out_norm"][h] = float(o.norm())
            out["p_max"][h] = float(p.max())
            out["tail_mass"][h] = float(p[tail].sum())
            if not certified:
                continue
            a = omp[kv, :s] * p[:s] ** 2  # (1 - pi) p^2 on the tail slots
            dev = v[kv, :s] - o
            var = float((a * dev.square().sum(-1)).sum())
            pt = p[tail]
            mass, sq = float(pt.sum()), float(pt.square().sum())
            out["variance"][h] = var
            out["ess_tail"][h] = mass**2 / sq if sq > 0 else 0.0
            out["n_tail"][h] = int(tail.sum())
            out["tail_max"][h] = float(pt.max()) if len(pt) else 0.0
            out["head_mass"][h] = max(float(p[:prefix].sum()) - mass, 0.0)
            # tr(C^2): the sketched ratio estimator, debiased by the sketched diagonal term, clamped
            sk = dev @ r  # (s, k) S_i = (v_i - o_hat) R
            c_s = (sk * a[:, None]).T @ sk
            psi = float(c_s.square().sum() / c_s.trace() ** 2)
            ratio = (SKETCH_K * psi - 1) / max(SKETCH_K + 1 - 2 * psi, 1e-12)
            diag = float((omp[kv, :s] * a**2 * sk.square().sum(-1) ** 2).sum())
            tc2 = ratio * var**2 - max(diag, 0.0) / (SKETCH_K * (SKETCH_K + 2))
            out["trace_c2"][h] = min(max(tc2, var**2 / d), var**2)
    var = out["variance"]
    out["radius95"] = Z95 * np.sqrt(np.maximum(var, 0))
    h_eff = np.where(out["trace_c2"] > 0, var**2 / out["trace_c2"], 1.0).clip(min=1.0)
    with np.errstate(invalid="ignore"):
        out["radius95_tight"] = np.sqrt(var * sps.chi2.ppf(0.95, h_eff) / h_eff)
    ratio = out["ess_tail"] / np.where(out["n_tail"] == 0, 1, out["n_tail"])
    out["certificate_trusted"] = (
        (out["ess_tail"] >= ESS_MIN) & (out["tail_mass"] >= TAIL_MASS_MIN) & (ratio >= ESS_RATIO_MIN) & np.isfinite(var)
    )
    return out


@pytest.fixture(scope="module")
def reference(run):
    """(policy index, step, layer) -> reference_step."""
    return {
        key: reference_step(x, run["prompt_keys"][key[2]], run["prompt_values"][key[2]])
        for key, x in run["steps"].items()
    }


# -------------------------------------------------------------------------------------------------- the inputs
def test_the_engine_attends_over_the_true_cache_with_the_documented_offsets(run):
    """Kept keys / values are the prompt's true keys / values at the compressed positions; -log pi on the tail (pi in
    (0, 1)), 0 on the head and on appended tokens, -inf on padding; appended layer-0 keys are the real tokens' keys."""
    checked_tail = 0
    for (p, step, layer), x in run["steps"].items():
        comp = run["comps"][POLICIES[p].label]
        idx = comp.indices[layer]  # (Hkv, m)
        m, prefix = idx.shape[-1], x["prefix"]
        assert m <= prefix and x["keys"].shape[1] == prefix + step + 1  # kept, padding, then one slot per token
        for kv in range(idx.shape[0]):
            torch.testing.assert_close(x["keys"][kv, :m], run["prompt_keys"][layer][kv, idx[kv]], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                x["values"][kv, :m], run["prompt_values"][layer][kv, idx[kv]], rtol=1e-5, atol=1e-5
            )
        off = x["offset"]
        assert torch.isneginf(off[:, m:prefix]).all(), "padding of the bucket's wider rows is -inf"
        assert (off[:, prefix:] == 0).all(), "appended tokens: pi = 1"
        valid = torch.isfinite(off[:, :m])  # a head that kept fewer tokens than the widest one is padded (-inf)
        for kv in range(idx.shape[0]):
            kept = idx[kv][valid[kv]]
            assert len(kept.unique()) == len(kept), "no position kept twice"
        if POLICIES[p].design == "topk":
            assert valid.all() and m == round(POLICIES[p].budget * N)
        s = x["tail_slots"] or 0
        if POLICIES[p].has_certificate:
            omp = x["one_minus_pi"]
            pi = 1 - omp
            real = omp > 0  # sampled tail slots (pi < 1); a head with a shorter tail has head tokens after it
            assert real.any() and ((pi[real] > 0) & (pi[real] < 1)).all()
            n_real = real.sum(-1, keepdim=True)
            assert torch.equal(real, torch.arange(s) < n_real), "the tail comes first in every head's slots"
            assert valid[:, :s][real].all()
            torch.testing.assert_close(off[:, :s][real], -pi[real].log(), rtol=1e-5, atol=1e-6)
            head = valid.clone()
            head[:, :s] &= ~real
            assert (off[:, :m][head] == 0).all(), "head and question tokens: pi = 1, offset 0"
            checked_tail += int(real.sum())
        else:
            assert (off[:, :m] == 0).all() and s == 0
        if layer == 0:  # independent of the compression: the generated tokens' keys at their real positions
            torch.testing.assert_close(
                x["keys"][:, prefix:], run["appended_k0"][p][:, : step + 1], rtol=1e-4, atol=1e-5
            )
    assert checked_tail > 0


def test_kept_counts_follow_the_budget(run):
    """window_question keeps the 20 question tokens, counted inside the budget; top-k keeps exactly
    round(budget * N) per head, the randomized design round(budget * N) - 20 drawn on average (head + Poisson tail)."""
    for pol in POLICIES[1:]:
        comp = run["comps"][pol.label]
        for idx in comp.indices:
            assert (idx[:, -(N - QS) :] == torch.arange(QS, N)).all(), "the question is always kept, last"
            drawn = idx[:, : -(N - QS)]
            assert (drawn < QS).all()
            if pol.design == "topk":
                assert drawn.shape[-1] == round(pol.budget * N) - (N - QS)
        expected = round(pol.budget * N)
        if pol.design == "topk":
            assert comp.kept_tokens == expected
        else:  # head exactly, tail Poisson with sum(pi) = its expected size: the mean over layers x heads is close
            assert abs(comp.kept_tokens - expected) < 0.25 * expected


# ---------------------------------------------------------------------------------------------- the statistics
STAT_TOL = {  # float32 engine vs float64 reference
    "out_norm": (1e-5, 1e-7),
    "p_max": (1e-5, 1e-9),
    "tail_mass": (1e-5, 1e-7),
    "variance": (1e-4, 1e-10),
    "error": (1e-4, 1e-6),
    "ess_tail": (1e-4, 1e-5),
    "n_tail": (0, 0),
    "tail_max": (1e-5, 1e-9),
    "head_mass": (1e-4, 1e-6),
    "trace_c2": (1e-4, 1e-14),  # the same estimator: agrees to ~1e-6 relative
}
# The tiny Qwen2.5's tr(C^2) is ~1e-7 (7 query heads per KV head, random q/k/v biases): the debiased sketch is a
# difference of float32 sums that nearly cancel there, so it agrees to ~1e-4 relative; its other statistics as above.
STAT_TOL_BY_ARCH = {"qwen2.5": {"trace_c2": (1e-3, 1e-14)}}


def test_hajek_output_is_offset_attention(run):
    for x in run["steps"].values():
        q, k, v = x["query"], x["keys"], x["values"]
        logits = torch.einsum("hgd,hld->hgl", q, k) * x["scale"] + x["offset"][:, None, :]
        torch.testing.assert_close(x["output"], torch.softmax(logits, -1) @ v, rtol=1e-5, atol=1e-6)
        assert x["mask"] is None  # single-token steps of full-attention layers: nothing to mask


def test_recorded_statistics_equal_the_float64_recomputation(run, reference):
    results = run["results"]
    compared = 0
    for (p, step, layer), ref in reference.items():
        stats = results[p].stats
        assert set(stats) == set(STAT_TOL), "every statistic recorded"
        for name, (rtol, atol) in {**STAT_TOL, **STAT_TOL_BY_ARCH.get(run["arch"], {})}.items():
            got = stats[name][step, layer].astype(np.float64)
            want = ref[name]
            assert np.array_equal(np.isnan(got), np.isnan(want)), (POLICIES[p].label, step, layer, name)
            assert np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True), (
                POLICIES[p].label,
                step,
                layer,
                name,
                got,
                want,
            )
            compared += int(np.isfinite(want).sum())
    assert compared > 0
    # the certificate is undefined (NaN), never zero, for top-k and the full cache; the error is always there
    for p, pol in enumerate(POLICIES):
        assert np.isnan(results[p].stats["variance"]).all() != pol.has_certificate
        assert np.isfinite(results[p].stats["error"]).all()
    assert results[0].stats["error"].max() < 1e-5, "the full cache is its own oracle"
    for b, pol in RANDOMIZED.items():
        var = results[POLICIES.index(pol)].stats["variance"]
        assert (var > 0).all(), b


def test_step_records_equal_the_reference(run, reference):
    """records.step_frame: radii (z95 sqrt(V_hat), and the Satterthwaite radius from scipy's chi-square), the trust
    flag, the float16 diagnostics and the -1 / NaN conventions where the certificate is undefined."""
    frame = records.step_frame("run", "ex-0", run["results"])
    assert list(frame.columns) == records.STEP_COLUMNS
    n_heads = run["model"].config.num_attention_heads
    assert len(frame) == len(POLICIES) * STEPS * run["n_layers"] * n_heads
    by_key = frame.set_index(["variant", "step", "layer", "head"]).sort_index()
    trusted_seen = {True: set(), False: set()}  # certified rows -> flag values seen
    for (p, step, layer), ref in reference.items():
        rows = by_key.loc[(POLICIES[p].label, step, layer)].sort_index()
        assert list(rows.index) == list(range(n_heads))
        for name in ("error", "variance", "radius95", "radius95_tight"):
            assert np.allclose(rows[name].to_numpy(np.float64), ref[name], rtol=1e-4, atol=1e-6, equal_nan=True), (
                name,
                rows[name].to_numpy(),
                ref[name],
            )
        for name in ("ess_tail", "tail_max", "head_mass"):  # float16 in the records: 3 significant digits
            got = rows[name].to_numpy(np.float64)
            assert np.allclose(got, ref[name], rtol=1e-3, atol=1e-4, equal_nan=True), (name, got, ref[name])
        n_tail = rows["n_tail"].to_numpy()
        assert (n_tail == np.nan_to_num(ref["n_tail"], nan=-1)).all()
        flag = rows["certificate_trusted"].to_numpy(bool)
        # equal wherever the float64 values are not within float32 rounding of a threshold
        ratio = ref["ess_tail"] / np.where(ref["n_tail"] == 0, 1, ref["n_tail"])
        with np.errstate(invalid="ignore"):
            edge = (
                np.isclose(ref["ess_tail"], ESS_MIN, rtol=1e-5)
                | np.isclose(ref["tail_mass"], TAIL_MASS_MIN, rtol=1e-5)
                | np.isclose(ratio, ESS_RATIO_MIN, rtol=1e-5)
            )
        assert (flag == ref["certificate_trusted"])[~edge].all(), (flag, ref["certificate_trusted"])
        trusted_seen[POLICIES[p].has_certificate].update(flag.tolist())
        if not POLICIES[p].has_certificate:
            assert rows["variance"].isna().all() and rows["radius95_tight"].isna().all() and not flag.any()
    assert trusted_seen[True] == {True, False}, "certified cells on both sides of the flag (budget 0.1: ESS ~ 10)"
    assert trusted_seen[False] == {False}  # top-k and the full cache: never trusted


# -------------------------------------------------------------------------------------------- the examples row
def test_example_row_by_hand(run):
    """records.example_frame's summaries of the 0.25 randomized row, from its step records and token log-probs; and
    the full cache's log-probs are plain transformers greedy decoding's."""
    from conftest import hf_greedy

    results = run["results"]
    example = Example(
        id="ex-0",
        task="single_needle",
        context="",
        question="",
        answers=("unlikely-gold",),
        depth=0.5,
        metric="ruler_any",
        target_tokens=N,
    )
    frame = records.example_frame("run", example, N, results)
    steps = records.step_frame("run", "ex-0", results)
    pol = RANDOMIZED[0.25]
    p = POLICIES.index(pol)
    row = frame.set_index("variant").loc[pol.label]
    cell = steps[steps["variant"] == pol.label]
    err = cell["error"].to_numpy(np.float64)
    out = cell["out_norm"].to_numpy(np.float64)
    radius = cell["radius95"].to_numpy(np.float64)
    lps = np.array(results[p].logprobs[: results[p].n_answer], dtype=np.float64)
    assert row["n_answer_tokens"] == STEPS == len(lps) and row["steps_total"] == len(cell)
    assert row["cert_score"] == pytest.approx(float(np.mean(radius / out)), rel=1e-5)
    assert row["rel_error_mean"] == pytest.approx(float(np.mean(err / out)), rel=1e-5)
    covered = cell["error"].to_numpy() <= cell["radius95"].to_numpy()  # float32, as both frames hold them
    assert row["covered95"] == float(covered.mean()) and row["steps95"] == int(covered.sum())
    assert row["logprob_mean"] == pytest.approx(sum(lps) / len(lps), rel=1e-12)
    assert row["logprob_min"] == min(lps)
    assert row["kept_tokens"] == run["comps"][pol.label].kept_tokens
    assert row["has_certificate"] and not row["nonfinite"] and row["uncompressed_layers"] == ""
    assert math.isnan(frame.set_index("variant").loc[TOPK.label, "cert_score"])
    # the log-probs are those of the tokens: the full-cache row equals plain transformers greedy decoding
    tokens, ref_lps = hf_greedy(run["model"], run["ids"], STEPS)
    assert results[0].tokens == tokens
    full = frame.set_index("variant").loc["full"]
    assert full["logprob_mean"] == pytest.approx(float(np.mean(ref_lps)), abs=1e-5)
    assert full["logprob_min"] == pytest.approx(min(ref_lps), abs=1e-5)
    assert all(r.tokens[0] == tokens[0] for r in results)  # compression after the prompt: the first token is the
    # full prefill's (kvpress' compress-after-prefill)
