"""The decoder layer's fused kernels inside the model, on the GPU (``cuda`` marker): a 4-layer
``glm5-tp8-rank`` (FP8 block weights, dummy weights, 3 dense layers and one MoE layer) gives the
logits of the same model with every fusion undone (:func:`unfused`: the separate Triton
kernels — norm, then the linears' own activation quantisation; RoPE, norm and ``cat``; the
split-K sum kernel; ``bmm`` then a copy; SiLU then the product — which the kernel tests check
the fused ones against), for prompts of 700, 37 and 1 tokens (the one-token prompt takes the
row-count paths of a bs-1 decode step: W8A8 Triton GEMMs with split K, W8A16 where the start-up
timing picks it).

The plain-PyTorch twins (``TRITON_ENABLED`` off) are no reference at this size: their FP8
linears keep bf16 activations, which moves the logits of random weights by ≈ 10% (e4m3
activations cost ≈ 2.5% per GEMM, and the router's top-8 of 256 changes with them); the error
against them is printed, not checked."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from breakgraph.bench.presets import PRESETS

pytestmark = pytest.mark.cuda


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo every fusion of the decoder layer (what the layer ran before them, kernel by kernel)."""
    from breakgraph.kernels import norm, rope, triton_fp8, triton_moe
    from breakgraph.kernels.causal_topk import causal_topk_ref
    from breakgraph.layers import attention, dsa
    from breakgraph.layers import norm as norm_layer

    def rms_norm_fp8(x, weight, eps, residual=None):
        if residual is None:
            return norm.rms_norm(x, weight, eps), None, None
        return (*norm.fused_add_rms_norm(x, residual, weight, eps), None)

    def mla_rope_kv(q, kv_a, cos, sin, weight, eps):
        r = weight.shape[0]
        dr = kv_a.shape[-1] - r
        q_full = q.new_empty(q.shape[0], q.shape[1], r + dr)
        q_full[..., r:] = rope.rope(q[..., q.shape[-1] - dr :], cos, sin, True)
        kv = torch.cat([norm.rms_norm(kv_a[:, :r], weight, eps), rope.rope(kv_a[:, r:], cos, sin, True)], dim=-1)
        return q_full, kv

    def indexer_rope_qk(q, k, cos, sin, weight, bias, eps, interleaved, rope_dim):
        k = F.layer_norm(k, (k.shape[-1],), weight, bias, eps)
        return rope.rope(q, cos, sin, interleaved, rope_dim), rope.rope(k, cos, sin, interleaved, rope_dim)

    def bmm_into(a, b, out):
        out.copy_(torch.bmm(a, b))

    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    monkeypatch.setattr(norm_layer, "rms_norm_fp8", rms_norm_fp8)
    monkeypatch.setattr(attention, "mla_rope_kv", mla_rope_kv)
    monkeypatch.setattr(attention, "indexer_rope_qk", indexer_rope_qk)
    monkeypatch.setattr(attention, "bmm_into", bmm_into)
    monkeypatch.setattr(dsa, "bmm_into", bmm_into)
    monkeypatch.setattr(dsa, "causal_topk", causal_topk_ref)
    monkeypatch.setattr(triton_fp8, "_split_k_locks", lambda device: None)
    monkeypatch.setattr(triton_moe, "silu_mul", silu_mul)


def test_fp8_model_with_fused_kernels_matches_the_unfused_kernels(tmp_path, monkeypatch):
    from breakgraph import Engine
    from breakgraph.kernels import dispatch

    (tmp_path / "config.json").write_text(json.dumps(dict(PRESETS["glm5-tp8-rank"], num_hidden_layers=4)))
    eng = Engine(tmp_path, device="cuda", load_format="dummy", page_size=64, num_pages=80, context_length=2048,
                 cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled")  # fmt: skip
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in (700, 37, 1)]
    fused = eng.prompt_logits(batch)
    with monkeypatch.context() as m:
        unfused(m)
        separate = eng.prompt_logits(batch)
    monkeypatch.setattr(dispatch, "TRITON_ENABLED", False)
    twins = eng.prompt_logits(batch)
    errs = [_rel(a, b) for a, b in zip(fused, separate)]
    print(f"fused vs unfused kernels, relative logit error per prompt: {[f'{e:.2e}' for e in errs]}")
    print(f"fused vs twins: {[f'{_rel(a, b):.2e}' for a, b in zip(fused, twins)]}, "
          f"unfused vs twins: {[f'{_rel(a, b):.2e}' for a, b in zip(separate, twins)]}")  # fmt: skip
    assert all(e < 5e-2 for e in errs), errs
