"""A bfloat16 model: the cache keeps the kept keys and values in bfloat16 (the model's dtype), and the attention,
the certificate and the oracle are computed in float32, in verification mode (oracle on) and serving mode (oracle
off). Checked against float64 on the captured inputs: a bf16 computation would be
off by about 1e-2 relative, float32 math by about 1e-6."""

from __future__ import annotations

import pytest
import torch

from kvcert.bench.common import no_eos
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.hf import compressed_state as compressed_state_module
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_random_model

N, QS, STEPS = 300, 280, 3
TOLERANCE = 1e-4  # relative, against float64 (docs/api.md states it)


@pytest.mark.parametrize("oracle", [True, False], ids=["verification", "serving"])
def test_bf16_model_runs_its_attention_certificate_and_oracle_in_float32(monkeypatch, oracle):
    model, _ = tiny_random_model("llama")
    model = model.to(torch.bfloat16)
    ids = torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="bf16")
    policy = Policy(scorer="window_question", design="randomized", budget=0.25, seed=1)
    seen = []
    real = compressed_state_module.Bucket.attend

    def spy(self, layer, query, key, value, scale, **kwargs):
        out = real(self, layer, query, key, value, scale, **kwargs)
        if query.shape[-2] == 1 and kwargs.get("stats") and layer == 0:
            buf = self.layers[0]
            assert buf.keys.dtype == buf.values.dtype == torch.bfloat16  # held in the model's dtype
            assert buf.offset.dtype == buf.one_minus_pi.dtype == torch.float32
            bsz, n_q, _, d = query.shape
            g = n_q // key.shape[1]
            seen.append(
                {
                    "q": query.double().reshape(bsz, -1, g, d),
                    "k": buf.key_slots(buf.length).double(),
                    "v": buf.values[:, :, : buf.length].double(),
                    "off": buf.offset[:, :, : buf.length].double(),
                    "omp": buf.one_minus_pi.double(),
                    "s": buf.tail_slots,
                    "scale": scale,
                    "rows": self.batch_size,
                }
            )
        return out

    monkeypatch.setattr(compressed_state_module.Bucket, "attend", spy)
    with no_eos(model):
        res = generate_variants(
            model, None, prompt, [FULL, policy], DecodeOptions(max_new_tokens=STEPS, backend="torch", oracle=oracle)
        )
    assert len(res[1].tokens) == STEPS and all(isinstance(t, int) for t in res[1].tokens)
    variance = res[1].stats["variance"]  # (steps, layers, Hq), float32
    assert variance.dtype.name == "float32" and (variance[:, 0] > 0).all()
    certified = [x for x in seen if x["rows"] == 1 and x["s"] > 0]  # the randomized row's bucket, layer 0
    assert len(certified) == STEPS
    for step, x in enumerate(certified):
        p = torch.softmax(x["q"] @ x["k"].transpose(-1, -2) * x["scale"] + x["off"][:, :, None, :], -1)
        o = p @ x["v"]
        s = x["s"]
        a = x["omp"][:, :, None, :s] * p[..., :s] ** 2
        v_hat = (a * (x["v"][:, :, None, :s, :] - o[..., None, :]).square().sum(-1)).sum(-1)  # (1, Hkv, g)
        engine = torch.from_numpy(variance[step, 0]).double()
        torch.testing.assert_close(engine, v_hat.reshape(-1), rtol=TOLERANCE, atol=1e-9)
