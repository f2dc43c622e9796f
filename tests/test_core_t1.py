"""T1 (kvcert.core.t1): the deterministic design is blind to a perturbation of its evicted values while its true
error grows; the randomized design's mean V_hat tracks the MSE. Also through the claim config (kvcert.reproduce)."""

from kvcert.core.t1 import t1_demonstration
from kvcert.reproduce import compose_claim, t1_from_config


def test_t1_deterministic_blind_randomized_tracks():
    r = t1_demonstration(
        lambdas=[0, 1, 3, 10, 30],
        n=400,
        d=32,
        budget=0.5,
        peakedness=1.5,
        draws=600,
        seed=11,
        tail_fraction=0.75,
        floor=0.2,
        score_power=1.0,
    )
    assert all(r["retained_identical"])
    assert r["estimate_deterministic"] == [0.0] * len(r["lambda"])
    err = r["true_error_deterministic"]
    assert all(b > a for a, b in zip(err, err[1:])) and err[-1] > 5 * err[0]
    ratios = [v / m for v, m in zip(r["mean_vhat_randomized"], r["mse_randomized"])]
    assert all(0.8 < x < 1.25 for x in ratios), ratios
    assert r["mse_randomized"][-1] > 3 * r["mse_randomized"][0]


def test_t1_from_the_claim_config_uses_its_parameters():
    cfg = compose_claim("t1_nonidentifiability", ["claim.t1.n=300", "claim.t1.d=16", "claim.t1.lambdas=[0,10]"])
    r = t1_from_config(cfg, draws=50)
    assert r["lambda"] == [0.0, 10.0] and all(r["retained_identical"])
