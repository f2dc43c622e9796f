"""The prefill probe inside a real forward (kvcert.hf.serving_prefill): each compressed layer's probe equals a float64
recomputation, query by query, from that layer's keys, values and queries and the policy's kept set; the probe-only
read gives the same numbers; layers and policies without compression carry none."""

from __future__ import annotations

import pytest
import torch

from kvcert.hf import DecodeOptions, Prompt, compress_while_reading, probe_prompt, tiny_random_model
from kvcert.hf.attention import CompressingState, attention_scale
from kvcert.hf.serving_prefill import PROBE_QUERIES
from kvcert.policy import FULL, Policy


def _naive_errors(q, k, v, kept, log_pi, positions, scale):
    """||o_hat - o|| per (query head, window query) in float64, one query at a time."""
    n_q, n_kv = q.shape[0], k.shape[0]
    g = n_q // n_kv
    out = torch.zeros(n_q, len(positions), dtype=torch.float64)
    for h in range(n_q):
        kv = h // g
        for i, t in enumerate(positions):
            p = torch.softmax(k[kv, : t + 1] @ q[h, t] * scale, 0)
            o = p @ v[kv, : t + 1]
            sel = kept[kv] <= t
            pos = kept[kv][sel]
            p_hat = torch.softmax(k[kv, pos] @ q[h, t] * scale - log_pi[kv][sel], 0)
            out[h, i] = (p_hat @ v[kv, pos] - o).norm()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2.5"])
def test_probe_equals_a_float64_recomputation_from_the_layers_own_tensors(monkeypatch, arch):
    model, _ = tiny_random_model(arch, seed=3)
    n, qs = 90, 70
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="probe-test")
    policies = [
        FULL,
        Policy(scorer="window_question", design="randomized", budget=0.5, tail_fraction=0.75, floor=0.2),
        Policy(scorer="window_question", design="topk", budget=0.5),
        Policy(scorer="key_norm", design="randomized", budget=0.5, tail_fraction=0.75, floor=0.2),
    ]
    seen: dict[int, tuple] = {}
    attend = CompressingState.attend

    def capture(self, layer, query, key, value, scale, window=None):
        seen[layer] = tuple(x[0].detach().double().clone() for x in (query, key, value))
        return attend(self, layer, query, key, value, scale, window)

    monkeypatch.setattr(CompressingState, "attend", capture)
    opts = DecodeOptions(max_new_tokens=2, oracle=False)
    batch = compress_while_reading(model, prompt, policies, opts, probe=True)
    only = probe_prompt(model, prompt, policies, opts)
    scale = attention_scale(model)
    assert batch.probes[0] == [None, None] and only[0] == [None, None]  # the full cache: nothing to probe
    for i in (1, 2, 3):
        comp = batch.comps[batch.rows.index(i)]
        positions = list(range(qs, n)) if i in (1, 2) else list(range(n - PROBE_QUERIES, n))
        for layer in range(model.config.num_hidden_layers):
            q, k, v = seen[layer]
            res = batch.probes[i][layer]
            log_pi = -comp.offset[layer].double()
            expected = _naive_errors(q, k, v, comp.indices[layer], log_pi, positions, scale)
            assert torch.allclose(res.error.double(), expected, rtol=1e-4, atol=1e-5), (i, layer)
            assert torch.equal(only[i][layer].error, res.error)
            if policies[i].design == "topk":
                assert (res.variance == 0).all()
            else:
                assert (res.variance > 0).any()
    assert any((batch.probes[i][0].error > 0).any() for i in (1, 2, 3))
