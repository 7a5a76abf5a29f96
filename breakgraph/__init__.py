"""breakgraph: a compact inference engine for GLM-5-class models (MLA + DSA + MoE) whose
prefill runs under breakable CUDA graphs."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import breakgraph.graphs` does not pull in the engine.
    if name == "Engine":
        from breakgraph.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from breakgraph.engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from breakgraph.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'breakgraph' has no attribute {name!r}")
