"""Pure analysis functions over the run records (`examples`, `steps` DataFrames): one module per claim family.

bootstrap     example-cluster resampling and percentile intervals (shared by everything below)
coverage      C1  certificate coverage, calibration, attention regimes, split-conformal multiplier
accuracy      C2, C3  paired accuracy differences, drop vs the full cache, row selection from spec filters
auroc         C4, C6  failure prediction and failure attribution AUROCs
intervention  C5, C7  ranked interventions: certificate-gated budget escalation, recomputation with the full cache
claims        the claims registry (predictions.yaml) and verdicts from its entries (ClaimResult)
scorecard     the scorecard (JSON, Markdown, HTML); figures renders the claims
tables        the descriptive tables beside the claims (CSV)
pilot         the pilot summary that chose the locked design parameters
"""
