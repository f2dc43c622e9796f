"""The HF side of the ported kvpress scorers' inputs (kvcert.core.scorers.inputs.ScorerInputs): the model's rotary
embedding as a plain function of positions and its layers' output projections, read once per model, and the
ScorerInputs of a set of layers from the tensors kvcert's attention already holds (no extra forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core.scorers import SCORERS, ScorerInputs
from kvcert.core.scorers.inputs import Rotary


def reads_inputs(policies) -> bool:
    """Whether any policy's scorer reads ScorerInputs (then verification mode captures the prompt's queries)."""
    return any(not p.is_full and p.scorer in SCORERS and SCORERS[p.scorer].reads_inputs for p in policies)


def model_rotary(model) -> Rotary | None:
    """positions (T,) -> (cos, sin) (T, d) in float32 from the model's shared rotary embedding; None without one."""
    rotary_emb = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary_emb is None:
        return None

    def rotary(positions: torch.Tensor) -> torch.Tensor:
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = rotary_emb(probe, positions[None])
        return cos[0].float(), sin[0].float()

    return rotary


@dataclass(frozen=True)
class ModelTensors:
    """What the ported scorers read of the model itself."""

    rotary: Rotary | None
    out_proj: list[torch.Tensor] | None  # per layer, o_proj.weight (hidden, Hq * d)

    @classmethod
    def of(cls, model) -> ModelTensors:
        layers = model.model.layers
        projections = [getattr(getattr(layer.self_attn, "o_proj", None), "weight", None) for layer in layers]
        return cls(model_rotary(model), None if any(w is None for w in projections) else projections)

    def inputs(self, layers: list[int], keys, values, queries) -> ScorerInputs:
        """ScorerInputs of `layers` from their region's keys/values (L, Hkv, region, d) and queries (L, Hq, region,
        d) or None."""
        out_proj = None if self.out_proj is None else torch.stack([self.out_proj[i] for i in layers])
        return ScorerInputs(keys=keys, values=values, queries=queries, rotary=self.rotary, out_proj=out_proj)
