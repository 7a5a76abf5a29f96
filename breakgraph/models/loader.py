"""Build the model and fill it from a Hugging Face checkpoint folder or with dummy weights.

Checkpoints: ``model.safetensors`` or shards listed in ``model.safetensors.index.json``;
bf16/fp32, or FP8 (``weight`` float8_e4m3fn + ``weight_scale_inv``). Each tensor is
checked against the model: a missing, unexpected or mis-shaped tensor is an error that
names it. Multi-token-prediction layers (index ≥ ``num_hidden_layers``) are skipped.

Tensor parallelism: each rank builds its own shard of the model (``parallel=``) and reads only
its piece of each sharded tensor from disk (safetensors slices), so no rank ever holds the
whole model. FP8 weights and their ``weight_scale_inv`` are sliced alike (the model refuses
shards that do not fall on block boundaries); a tensor dequantised on load (tiny models) is
read whole, dequantised, then sliced.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from breakgraph.distributed import ParallelState, Shard, parallel_state
from breakgraph.kernels.fp8 import FP8_DTYPE, block_dequant
from breakgraph.layers.rotary import RotaryEmbedding
from breakgraph.models.config import ModelConfig
from breakgraph.models.glm5 import DsaForCausalLM

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")


class CheckpointError(ValueError):
    """The checkpoint does not match the model built from its config."""


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    max_positions: int | None = None,
    parallel: ParallelState | None = None,
) -> DsaForCausalLM:
    """Construct the model (``parallel``: this tensor-parallel rank's shard) with
    uninitialised weights directly on ``device`` (no CPU copy)."""
    device = torch.device(device)
    with parallel_state(parallel), torch.device("meta"):
        model = DsaForCausalLM(config, dtype, max_positions=1)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    positions = max_positions or config.max_position_embeddings
    if device.type != "meta":
        model.model.rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim, positions).to(device)
    return model.eval()


def load_model(
    model_path: str | Path | None,
    *,
    config: ModelConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    load_format: str = "auto",
    max_positions: int | None = None,
    seed: int = 0,
    parallel: ParallelState | None = None,
) -> DsaForCausalLM:
    """Build the model for ``model_path`` (or ``config``) and fill its weights.

    ``load_format``: ``auto``/``safetensors`` read the checkpoint; ``dummy`` draws seeded
    random weights (any config, no files needed beyond config.json; every rank draws the same
    values for its replicated tensors). ``parallel``: build and load this tensor-parallel
    rank's shard only.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if config is None:
        if model_path is None:
            raise ValueError("give a model path or a config")
        config = ModelConfig.from_pretrained(model_path)
    model = build_model(config, device, dtype, max_positions, parallel)
    if torch.device(device).type == "meta":
        return model
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_checkpoint(model, Path(model_path))
    model.process_weights_after_loading()
    return model


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name → safetensors file, from the index or by listing ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index.name} lists {f.name}, which is not in {folder}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    files: dict[str, Path] = {}
    for f in shards:
        with safe_open(f, framework="pt") as handle:
            files.update({name: f for name in handle.keys()})
    return files


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def load_checkpoint(model: DsaForCausalLM, folder: Path) -> None:
    """Fill ``model`` from the safetensors checkpoint in ``folder`` (see module doc)."""
    files = checkpoint_files(folder)
    required, aliases = model.checkpoint_targets()
    num_layers = model.config.num_hidden_layers
    block = model.config.fp8.block if model.config.fp8 else (128, 128)
    device = model.lm_head.weight.device
    loaded: set[str] = set()
    consumed_scales: set[str] = set()
    unexpected: list[str] = []
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(files.values())}

        def get(name: str, shard: Shard | None = None) -> torch.Tensor:
            """The tensor, or only this rank's ``shard`` of it (read from disk as a slice)."""
            if shard is None:
                return handles[files[name]].get_tensor(name)
            piece = handles[files[name]].get_slice(name)
            return piece[shard.index(tuple(piece.get_shape()), name)]

        for name in tqdm(sorted(files), desc="Loading weights", unit="tensor", leave=False):
            m = _LAYER_RE.match(name)
            if (m and int(m.group(1)) >= num_layers) or name.endswith("rotary_emb.inv_freq"):
                continue  # multi-token-prediction layers and recomputed buffers
            if name in required:
                target, covers = required[name], [name]
            elif name in aliases:
                target, covers = aliases[name]
            elif name.endswith("weight_scale_inv"):
                continue  # checked below: consumed by dequantise-on-load or required
            else:
                unexpected.append(name)
                continue
            dequantize = target.dtype != FP8_DTYPE and _stored_dtype(handles[files[name]], name) == FP8_DTYPE
            tensor = get(name, None if dequantize else target.shard)
            if dequantize:
                scale_name = name[: -len("weight")] + "weight_scale_inv"
                if scale_name not in files:
                    raise CheckpointError(f"tensor {name!r} is FP8 but {scale_name!r} is missing")
                tensor = block_dequant(tensor, get(scale_name), block, target.dtype)
                consumed_scales.add(scale_name)
                if target.shard is not None:
                    tensor = target.shard.take(tensor, name)
            target.load(tensor.to(device))
            loaded.update(covers)
    unexpected += [
        n for n in files
        if n.endswith("weight_scale_inv") and n not in required and n not in consumed_scales
        and not ((m := _LAYER_RE.match(n)) and int(m.group(1)) >= num_layers)
    ]  # fmt: skip
    if unexpected:
        raise CheckpointError(
            f"checkpoint {folder} has {len(unexpected)} tensor(s) the model does not use, e.g. {unexpected[:5]}"
        )
    missing = sorted(set(required) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {folder} is missing {len(missing)} tensor(s), e.g. {missing[:5]}")


def _stored_dtype(handle, name: str) -> torch.dtype | None:
    """The dtype of ``name`` on disk, read from the header (no data)."""
    dtype = handle.get_slice(name).get_dtype()
    return _SAFETENSORS_DTYPES.get(dtype)


_SAFETENSORS_DTYPES = {"F8_E4M3": FP8_DTYPE}


def init_dummy_weights(model: DsaForCausalLM, seed: int = 0) -> None:
    """Seeded random weights: N(0, 0.02) for matrices (FP8: random e4m3 codes with a scale; the
    fp32 router and indexer head-weight projections rounded to bf16 values), ones for norm
    weights, zeros for biases and the router correction bias."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for name, param in _unique_params(model):
        data = param.data
        if name.endswith("norm.weight"):
            data.fill_(1.0)
        elif name.endswith(("bias", "e_score_correction_bias")):
            data.zero_()
        elif name.endswith(("weight_scale_inv", "_scale")):
            data.fill_(0.02 / 0.6)  # the e4m3 codes drawn below have an RMS of ~0.55
        elif data.dtype == FP8_DTYPE:
            codes = data.view(torch.uint8)
            codes.random_(0, 0x3F, generator=gen)  # magnitudes 0 … 1.75
            codes.bitwise_or_(torch.randint_like(codes, 0, 2, generator=gen) << 7)
        else:
            data.normal_(0.0, 0.02, generator=gen)
            if name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight")):
                data.copy_(data.to(torch.bfloat16))  # as a checkpoint that stores these in bf16


def _unique_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p
