"""The claim experiments (kvcert.reproduce): the registry's configs compose with the runner and C1-C7 share one
confirmatory cell. The analysis end to end is tests/test_golden.py (byte-identical outputs on committed records)."""

import pytest

from conftest import compose
from kvcert.analysis.claims import registry
from kvcert.config import policies, result_name, validate
from kvcert.reproduce import compose_claim

CLAIMS = registry()


def test_claims_c1_to_c7_share_one_confirmatory_cell():
    names = {result_name(compose_claim(e.experiment)) for e in CLAIMS.values() if e.analysis != "t1"}
    assert len(names) == 1
    cfg = compose_claim("c1_coverage")
    validate(cfg)
    labels = [p.label for p in policies(cfg)]
    assert len(labels) == len(set(labels))  # no variant twice
    designs = {p.design for p in policies(cfg)}
    assert designs == {"full", "topk", "randomized", "randomized_no_offset", "uniform"}
    assert cfg.seed != compose_claim("pilot").seed  # pilot and confirmatory data are disjoint


@pytest.mark.parametrize("cid", list(CLAIMS))
def test_claim_configs_compose_with_the_runner(cid):
    cfg = compose([f"+claim={CLAIMS[cid].experiment}"])
    validate(cfg)
    assert cfg.claim.id == cid
