"""The mathematics of kvcert in plain torch (no transformers import).

designs    -> which tokens a budget keeps, with their inclusion probabilities (Selection)
scorers    -> importance scores per (layer, KV head, token)
hajek      -> offset attention, the certificate variance and radius, the exact attention and error
certificate -> tr(C^2) (exact), the tight (Satterthwaite) radius, per-cell tail diagnostics
sketch     -> tr(C^2) through a fixed Gaussian sketch of the value space (the decode hot path)
perturb    -> the non-identifiability construction
"""

from kvcert.core.certificate import (
    certificate_stats,
    chi2_quantile,
    conservative_radius,
    effective_dimension,
    tail_diagnostics,
    tight_radius,
    trace_c2_exact,
)
from kvcert.core.designs import DESIGNS, get_design
from kvcert.core.hajek import (
    HajekResult,
    certificate_radius,
    error_norm,
    exact_attention,
    gather_tokens,
    hajek_attention,
    z_value,
)
from kvcert.core.perturb import evicted_mask, perturb_values
from kvcert.core.probabilities import inclusion_probabilities, poisson_sample
from kvcert.core.scorers import key_norm_scores, random_scores, streaming_scores, window_scores
from kvcert.core.selection import Selection, keep_count, split_head_tail
from kvcert.core.sketch import SketchedTail, make_sketch, sketch_tail, sketch_values, sketched_trace_c2

__all__ = [
    "DESIGNS",
    "HajekResult",
    "Selection",
    "SketchedTail",
    "certificate_radius",
    "certificate_stats",
    "chi2_quantile",
    "conservative_radius",
    "effective_dimension",
    "error_norm",
    "evicted_mask",
    "exact_attention",
    "gather_tokens",
    "get_design",
    "hajek_attention",
    "inclusion_probabilities",
    "keep_count",
    "make_sketch",
    "key_norm_scores",
    "perturb_values",
    "poisson_sample",
    "random_scores",
    "sketch_tail",
    "sketch_values",
    "sketched_trace_c2",
    "split_head_tail",
    "streaming_scores",
    "tail_diagnostics",
    "tight_radius",
    "trace_c2_exact",
    "window_scores",
    "z_value",
]
