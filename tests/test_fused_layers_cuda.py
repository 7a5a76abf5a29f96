"""The decoder layer's fused kernels inside the model, on the GPU (``cuda`` marker): a 4-layer
``glm5-tp8-rank`` (FP8 block weights, dummy weights, 3 dense layers and one MoE layer) gives the
logits of its plain-PyTorch twins (``TRITON_ENABLED`` off: no fused norm + quantisation, no
fused RoPE, no split-K epilogue, bf16-activation FP8 linears) to within what W8A8 activations
cost, for prompts of 700, 37 and 1 tokens (the one-token prompt takes the row-count paths of
a bs-1 decode step: W8A8 Triton GEMMs with split K, W8A16 where the start-up timing picks it)."""

from __future__ import annotations

import json

import pytest
import torch

from breakgraph.bench.presets import PRESETS

pytestmark = pytest.mark.cuda


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_model_with_fused_kernels_matches_the_twins(tmp_path, monkeypatch):
    from breakgraph import Engine
    from breakgraph.kernels import dispatch

    (tmp_path / "config.json").write_text(json.dumps(dict(PRESETS["glm5-tp8-rank"], num_hidden_layers=4)))
    eng = Engine(tmp_path, device="cuda", load_format="dummy", page_size=64, num_pages=80, context_length=2048,
                 cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled")  # fmt: skip
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in (700, 37, 1)]
    fused = eng.prompt_logits(batch)
    monkeypatch.setattr(dispatch, "TRITON_ENABLED", False)
    twins = eng.prompt_logits(batch)
    errs = [_rel(a, b) for a, b in zip(fused, twins)]
    print(f"fused vs twins, relative logit error per prompt: {[f'{e:.2e}' for e in errs]}")
    assert all(e < 5e-2 for e in errs), errs
