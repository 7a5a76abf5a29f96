"""Every engine setting in one frozen dataclass: name, default, type, allowed values and help
stated once, in the field. The CLI flags (:func:`breakgraph.cli.add_engine_arguments`), the
keyword construction ``Engine(model_path, device=..., ...)`` and what tensor-parallel ranks
are told all come from these fields, so adding a setting is one line here.

The engine's environment knobs (``BREAKGRAPH_TP_*``, see :mod:`breakgraph.env`) are fields
too, without a flag: their defaults are read from the environment once, when the config is
built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from breakgraph import env
from breakgraph.graphs.backends import DECODE_BACKENDS, PREFILL_BACKENDS  # the registry of graph backends
from breakgraph.graphs.prefill_runner import LADDERS
from breakgraph.graphs.warmup import WARMUPS

ENGINE = "model and engine"
GRAPHS = "graphs"
PARALLEL = "parallelism"

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def setting(
    default: Any,
    help: str,
    *,
    group: str = ENGINE,
    type: type = str,
    choices: tuple[str, ...] | None = None,
    nargs: str | None = None,
) -> Any:
    """A config field with a command-line flag ``--<name-with-dashes>`` in ``group``."""
    meta = {"help": help, "group": group, "type": type, "choices": choices, "nargs": nargs}
    return field(default=default, metadata=meta)


def env_knob(name: str, type: type = float) -> Any:
    """A config field without a flag whose default is environment variable ``name``, read
    when the config is built."""
    return field(default_factory=lambda: type(env.read(name)), metadata={"env": name})


@dataclass(frozen=True)
class EngineConfig:
    """The settings of one :class:`~breakgraph.Engine` (see each field's help)."""

    model_path: str | None = setting(
        None, "HF checkpoint folder (config.json, *.safetensors, tokenizer.json); default: the built-in tiny GLM-5 model"
    )
    device: str | None = setting(None, "cuda or cpu (default: cuda when available)")
    dtype: str = setting(
        "auto", "activation/weight dtype; auto = bfloat16 on CUDA, float32 on CPU (FP8 weights stay FP8)",
        choices=DTYPES,
    )  # fmt: skip
    load_format: str = setting(
        "auto", "auto/safetensors read the checkpoint; dummy draws seeded random weights from config.json",
        choices=LOAD_FORMATS,
    )  # fmt: skip
    kv_cache_dtype: str = setting(
        "auto", "latent KV cache storage: auto = the activation dtype; fp8_e4m3 = the latent values in e4m3 with one "
        "fp32 scale per 128 and the RoPE part in bf16 (GLM-5: 656 bytes per token and layer instead of 1152 in bf16)",
        choices=KV_CACHE_DTYPES,
    )  # fmt: skip
    context_length: int | None = setting(None, "longest prompt + output in tokens (default: the model's)", type=int)
    page_size: int = setting(16, "tokens per KV-cache page", type=int)
    num_pages: int | None = setting(None, "KV-cache pages (default: sized from free memory)", type=int)
    mem_fraction_static: float = setting(
        0.85, "on CUDA, the share of free memory (after weights) the KV cache may take", type=float
    )
    max_running_requests: int = setting(64, "most requests decoding at once", type=int)
    kv_watermark: float = setting(
        0.01, "share of the KV pages admission keeps free for running requests to grow into (a request is "
        "admitted with its prompt's pages, not its whole budget; when decode runs out of pages the newest request "
        "is preempted and recomputed later)", type=float,
    )  # fmt: skip
    chunked_prefill_size: int = setting(4096, "most prompt tokens per prefill step", type=int)
    seed: int = setting(0, "seed for dummy weights", type=int)
    cuda_graph_backend_prefill: str | None = setting(
        None, "prefill under graphs: breakable (breakable CUDA graphs), piecewise (torch.compile split at the split "
        "ops), torch-compile (regional torch.compile of each decoder layer, mode reduce-overhead; also runs decode, "
        "so decode graphs stay off; TP 1 only) or disabled (eager). Default: breakable on CUDA, disabled on CPU; "
        "on CPU the graph backends run on the CPU graph backend", group=GRAPHS, choices=PREFILL_BACKENDS,
    )  # fmt: skip
    cuda_graph_bs_prefill: tuple[int, ...] | None = setting(
        None, "token counts to capture prefill graphs for (default: the --cuda-graph-ladder up to "
        "--cuda-graph-max-bs-prefill)", group=GRAPHS, type=int, nargs="+",
    )  # fmt: skip
    cuda_graph_ladder: str = setting(
        "coarse", "default buckets: coarse = prefill 4, 8, 16 … 256 (powers of two), 384, 512, 768, 1024, then quarter "
        "steps (1280, 1536, 1792, 2048, 2560 … 4096: 19 buckets; a batch pads by < 2x below 256 tokens, <= 50%% to "
        "1024, <= 25%% above) and decode 1, 2, 4, 8, then every 16; fine = prefill 4…32 step 4 … 1280…4096 step 256 "
        "(50 buckets) and decode every 8, as before",
        group=GRAPHS, choices=LADDERS,
    )  # fmt: skip
    cuda_graph_warmup: str = setting(
        "once", "eager warm-up before a capture: once = the largest bucket (and batch size) only, the others are "
        "captured directly and warmed up only where a Triton kernel would compile inside the capture; every = before "
        "each bucket's capture (always so with --tp-size > 1)", group=GRAPHS, choices=WARMUPS,
    )  # fmt: skip
    cuda_graph_max_bs_prefill: int | None = setting(
        None, "largest prefill bucket in tokens (default: min(--chunked-prefill-size, 4096)); prefill chunks never "
        "exceed it", group=GRAPHS, type=int,
    )  # fmt: skip
    cuda_graph_backend_decode: str | None = setting(
        None, "decode under full graphs, one per batch-size bucket (default: full on CUDA, disabled on CPU and "
        "with --cuda-graph-backend-prefill torch-compile)",
        group=GRAPHS, choices=DECODE_BACKENDS,
    )  # fmt: skip
    cuda_graph_max_bs: int | None = setting(
        None, "largest decode batch captured (default: min(--max-running-requests, 64))", group=GRAPHS, type=int
    )
    fold_islands: bool = setting(
        False, "run single-kernel graph segments eagerly inside the neighbouring break", group=GRAPHS, type=bool
    )
    tp_size: int = setting(
        1, "tensor-parallel ranks, one process each (one GPU each on CUDA), started by breakgraph (or by torchrun "
        "when RANK/WORLD_SIZE are set)", group=PARALLEL, type=int,
    )  # fmt: skip
    tp_timeout_s: float = env_knob("BREAKGRAPH_TP_TIMEOUT_S")
    tp_grace_s: float = env_knob("BREAKGRAPH_TP_GRACE_S")

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: kept by name, so the config stays plain data
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        for name in ("model_path", "device"):  # a Path or torch.device: kept as its string
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))
        if self.cuda_graph_bs_prefill is not None:
            object.__setattr__(self, "cuda_graph_bs_prefill", tuple(self.cuda_graph_bs_prefill))
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"--{flag_name(f.name)} must be one of {list(choices)}, got {value!r}")
        if self.cuda_graph_backend_prefill == "torch-compile":
            if self.tp_size > 1:
                raise ValueError("--cuda-graph-backend-prefill torch-compile runs in one process: it cannot run with --tp-size > 1")
            if self.cuda_graph_backend_decode == "full":
                raise ValueError(
                    "--cuda-graph-backend-prefill torch-compile compiles the layers decode runs too: "
                    "use --cuda-graph-backend-decode disabled"
                )
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"--kv-watermark must be in [0, 1), got {self.kv_watermark}")
        for name in ("chunked_prefill_size", "max_running_requests", "page_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (checked like a new config)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (what a tensor-parallel rank is sent)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Inverse of :meth:`to_dict`; raises ``TypeError`` naming an unknown field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"EngineConfig has no setting {unknown[0]!r}")
        return cls(**values)


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def flag_fields(group: str | None = None) -> list[dataclasses.Field]:
    """The fields that have a command-line flag (of ``group``, or all)."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata and group in (None, f.metadata["group"])]
