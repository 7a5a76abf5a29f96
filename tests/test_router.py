"""fp32 products of bf16 activations (MoE router logits, indexer head weights): on the tensor
cores as a bf16 GEMM with fp32 output when the weight is bf16-exact (CUDA), else an fp32
``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from breakgraph.kernels.linear import exact_bf16_weight, linear_fp32_out
from breakgraph.layers.mlp import MoE, Router
from breakgraph.models.config import ModelConfig
from breakgraph.models.loader import load_model


def _router(device: str, hidden: int = 512, experts: int = 64) -> Router:
    cfg = ModelConfig.from_dict(
        {"model_type": "glm_moe_dsa", "hidden_size": hidden, "n_routed_experts": experts, "n_group": 1,
         "topk_group": 1, "num_experts_per_tok": 8, "rope_parameters": {"rope_theta": 1e6}}
    )  # fmt: skip
    return Router(cfg).to(device)


def test_dummy_fp32_projections_are_bf16_values_and_the_cpu_path_stays_fp32(hf_checkpoints):
    model = load_model(hf_checkpoints["glm_moe_dsa"], dtype=torch.float32, load_format="dummy", seed=1)
    routers = [layer.mlp.gate for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    assert routers and indexers
    for w, copy in [(r.weight, r.weight_bf16) for r in routers] + [
        (i.weights_proj.weight, i.weights_proj_bf16) for i in indexers
    ]:
        w = w.detach()
        assert w.dtype == torch.float32 and w.abs().sum() > 0
        assert torch.equal(w.to(torch.bfloat16).float(), w), "dummy weights hold bf16 values"
        assert copy is None, "the bf16 GEMM path is CUDA-only"
    x = torch.randn(5, routers[0].weight.shape[1]).bfloat16()
    torch.testing.assert_close(routers[0].logits(x), F.linear(x.float(), routers[0].weight), rtol=0, atol=0)
    torch.testing.assert_close(linear_fp32_out(x, routers[0].weight.bfloat16()), F.linear(x.float(), routers[0].weight))
    # the copies are non-persistent buffers: they move with the module, checkpoints never see them
    routers[0].weight_bf16 = routers[0].weight.detach().bfloat16()
    assert "weight_bf16" in dict(routers[0].named_buffers())
    assert not any(k.endswith(("weight_bf16", "weights_proj_bf16")) for k in model.state_dict())


@pytest.mark.cuda
def test_router_bf16_gemm_matches_fp32_logits_on_cuda():
    torch.manual_seed(0)
    r = _router("cuda", hidden=6144, experts=256)
    with torch.no_grad():
        r.weight.normal_(0, 0.02)
        r.weight.copy_(r.weight.bfloat16().float())
    assert r.prepare_bf16_gemm()
    x = torch.randn(1024, 6144, device="cuda").bfloat16()
    ref = F.linear(x.double(), r.weight.double())
    fast = r.logits(x)
    assert fast.dtype == torch.float32
    rel = ((fast.double() - ref).norm() / ref.norm()).item()
    rel_fp32 = ((F.linear(x.float(), r.weight).double() - ref).norm() / ref.norm()).item()
    # same operands; the tensor cores' fp32 accumulation: 3.2e-6 measured on the H200 (fp32
    # GEMM 2.2e-7), far inside bf16 activation rounding (2^-8 ≈ 4e-3)
    assert rel <= 1e-5 and rel_fp32 <= 1e-6, (rel, rel_fp32)
    compiled = torch.compile(r.logits, fullgraph=True)
    assert ((compiled(x).double() - ref).norm() / ref.norm()).item() <= 1e-5
    # weights with more than bf16's mantissa keep the fp32 GEMM
    with torch.no_grad():
        r.weight.add_(torch.randn_like(r.weight) * 1e-6)
    assert not r.prepare_bf16_gemm() and exact_bf16_weight(r.weight) is None
    torch.testing.assert_close(r.logits(x), F.linear(x.float(), r.weight), rtol=0, atol=0)


@pytest.mark.cuda
def test_indexer_head_weights_take_the_bf16_gemm_after_loading(hf_checkpoints):
    """Loading prepares the indexers' bf16 copies; the custom op gives the fp32 result."""
    from breakgraph.layers.dsa import logits_head_gate

    model = load_model(hf_checkpoints["glm_moe_dsa"], dtype=torch.bfloat16, device="cuda", load_format="dummy")
    indexer = next(layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None)
    assert indexer.weights_proj_bf16 is not None
    x = torch.randn(300, indexer.weights_proj.weight.shape[1], device="cuda").bfloat16()
    got = logits_head_gate(x, indexer.weights_proj_bf16, 0.25)
    want = F.linear(x.double(), indexer.weights_proj.weight.double()) * 0.25
    assert got.dtype == torch.float32
    assert ((got.double() - want).norm() / want.norm()).item() <= 1e-5
