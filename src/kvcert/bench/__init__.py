"""Speed, memory and roofline benchmark of kvcert's decoding: ratios measured within one run.

    python -m kvcert.bench [--quick] [--device cpu|cuda] [--dtype float32|bfloat16] [--out results/bench]
    python -m kvcert.bench --integration            # load / prefill / decode-step table of the HF integration
    python -m kvcert.bench.cluster_check [--install] # `make cluster-check`

Modules: `common` (profiles, synthetic workload, `StepTimer`: decode steps timed through
`generate_variants(..., on_step=...)`), `measure` (in-process measurements), `roofline` (byte / flop accounting,
bandwidth and matmul throughput, the roofline sweep), `child` (the child-process protocol: memory and
OMP_WAIT_POLICY measurements in fresh processes), `report` (markdown and figures), `cli` (`run_bench`, `main`),
`cluster_check`.

Sections of `results/bench/bench_<device>.md`: 1. shared prefill + batched variants vs re-prefilling per variant;
2. decode-step cost of plain / certificate / certificate + oracle and the attention kernel alone; 3. scaling
slopes; 4. peak memory; 5. thread settings; 6. seconds per confirmatory example (21 variants) on the torch-ops
backend / the compiled backend (`decode.backend`); 7. the roofline. Headline keys of the JSON:
`shared_prefill_speedup`, `certificate_overhead`, `roofline_multiple`, `example_speedup`.
`python -m kvcert.bench.gpu_check` (`make gpu-check`): the CUDA tests and a small decode bench on a GPU.
One-run scripts beside it: `read` (the read against one plain forward), `step` (one decode step's parts against its
roofline limit and one-thread floor), `draws` (what R draws cost), `long_prompt` (peak memory at 8k-32k tokens),
`kvpress_speed` (kvpress itself under its protocol, with the ratio's ceilings).
"""

from kvcert.bench.cli import bench_integration, main, run_bench
from kvcert.bench.common import FULL_CONFIG, QUICK_CONFIG, BenchConfig, StepTimer, policy_grid
from kvcert.bench.roofline import ModelShape, VariantLoad, step_cost

__all__ = [
    "BenchConfig",
    "FULL_CONFIG",
    "ModelShape",
    "QUICK_CONFIG",
    "StepTimer",
    "VariantLoad",
    "bench_integration",
    "main",
    "policy_grid",
    "run_bench",
    "step_cost",
]
