"""Pure analysis functions over the run records (`examples`, `steps` DataFrames): one module per claim family.

bootstrap  example-cluster resampling and percentile intervals (shared by everything below)
coverage   C1  certificate coverage, calibration, attention regimes, split-conformal multiplier
accuracy   C2, C3  paired accuracy differences, drop vs the full cache, row selection from spec filters
auroc      C4, C6  failure prediction and failure attribution AUROCs
gating     C5  certificate-gated budget escalation
recompute  C7  recomputation with the full cache
claims     verdicts from predictions.yaml entries; scorecard and figures render them
"""
