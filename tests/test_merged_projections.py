"""The merged projections: ``q_a ‖ indexer wk ‖ kv_a``, one linear of the normed input in place of
three, and ``q_b ‖ indexer wq_b``, one linear of ``q_resid`` in place of two; made after loading,
equal to what they replace."""

import pytest
import torch

from breakgraph import Engine
from breakgraph.kernels.fp8 import block_quant
from breakgraph.layers.attention import MLAttention
from breakgraph.layers.linear import ReplicatedLinear, merge_linears
from breakgraph.models.config import Fp8Config


def _linear(k: int, n: int, fp8: bool, bias: bool = False, seed: int = 0) -> ReplicatedLinear:
    g = torch.Generator().manual_seed(seed)
    lin = ReplicatedLinear(k, n, bias=bias, fp8=Fp8Config() if fp8 else None, dtype=torch.float32)
    w = torch.randn(n, k, generator=g) / k**0.5
    if fp8:
        q, s = block_quant(w)
        lin.weight.data.copy_(q)
        lin.weight_scale_inv.data.copy_(s)
    else:
        lin.weight.data.copy_(w)
    if bias:
        lin.bias.data.copy_(torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize("fp8", [False, True])
def test_merged_linear_equals_its_parts_side_by_side(fp8):
    parts = [_linear(256, 128, fp8, seed=1), _linear(256, 128, fp8, bias=True, seed=2), _linear(256, 72, fp8, seed=3)]
    x = torch.randn(5, 256)
    want = torch.cat([p(x) for p in parts], dim=-1)
    merged = merge_linears(parts)
    assert merged is not None and merged.output_sizes == [128, 128, 72]
    assert merged.quantized == fp8 and (merged.weight_scale_inv is not None) == fp8
    torch.testing.assert_close(merged(x), want, rtol=1e-5, atol=1e-5)
    # the parts now read the merged storage and still compute what they did
    assert parts[2].weight.data_ptr() == merged.weight[256:].data_ptr()
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), want, rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_first_parts_alone_equal_the_merged_columns_from_their_rows_only(fp8, monkeypatch):
    """``forward_first`` gives the merged output's leading columns, computed from the leading
    parts' weight rows, scale rows and bias only (what a decode step without the indexer's
    queries runs in place of ``q_b ‖ wq_b``)."""
    from breakgraph.layers import linear as linear_mod

    parts = [_linear(256, 128, fp8, bias=True, seed=4), _linear(256, 256, fp8, seed=5), _linear(256, 72, fp8, seed=6)]
    merged = merge_linears(parts)
    x = torch.randn(3, 256)
    full = merged(x)
    seen = []

    def spy(x, weight, scale, block, bias=None, x_fp8=None):
        seen.append((weight.shape[0], None if scale is None else scale.shape[0], None if bias is None else bias.shape[0]))
        return real(x, weight, scale, block, bias, x_fp8)

    real = linear_mod.linear
    monkeypatch.setattr(linear_mod, "linear", spy)
    for n_parts, cols in ((1, 128), (2, 384), (3, 456)):
        torch.testing.assert_close(merged.forward_first(x, n_parts), full[:, :cols], rtol=1e-6, atol=1e-6)
    assert seen == [(128, 1 if fp8 else None, 128), (384, 3 if fp8 else None, 384), (456, 4 if fp8 else None, 456)]
    merged.partial_parts = (1, 2)
    assert merged.partial_shapes() == {(256, 128), (256, 384)}
    with pytest.raises(ValueError, match="no first 4"):
        merged.forward_first(x, 4)


def test_merge_is_refused_where_layouts_do_not_allow_it():
    # an FP8 part other than the last that does not end on a 128-row block boundary
    assert merge_linears([_linear(256, 72, True), _linear(256, 128, True)]) is None
    # different inputs, or FP8 beside high precision
    assert merge_linears([_linear(256, 128, False), _linear(128, 128, False)]) is None
    assert merge_linears([_linear(256, 128, True), _linear(256, 128, False)]) is None


def test_engine_merges_the_projections_and_logits_do_not_change(hf_checkpoints, monkeypatch):
    folder = hf_checkpoints["glm_moe_dsa"]
    ids = [torch.arange(3, 40).tolist(), torch.arange(50, 61).tolist()]
    merged = Engine(folder, device="cpu", dtype="float32", page_size=4)
    layers = [layer.self_attn for layer in merged.model.model.layers]
    assert all(a.fused_a_proj is not None and a.q_a_proj is None and a.kv_a_proj_with_mqa is None for a in layers)
    with_indexer = [a for a in layers if a.indexer is not None]
    assert with_indexer and all(len(a.fused_a_proj.output_sizes) == 3 and a.indexer.wk is None for a in with_indexer)
    assert all(a.fused_b_proj is not None and a.q_b_proj is None and a.indexer.wq_b is None for a in with_indexer)
    assert all(a.fused_b_proj is None and a.q_b_proj is not None for a in layers if a.indexer is None)
    monkeypatch.setattr(MLAttention, "merge_a_projections", lambda self: False)
    monkeypatch.setattr(MLAttention, "merge_b_projections", lambda self: False)
    separate = Engine(folder, device="cpu", dtype="float32", page_size=4)
    assert all(a.self_attn.fused_a_proj is None and a.self_attn.fused_b_proj is None for a in separate.model.model.layers)
    for got, want in zip(merged.prompt_logits(ids), separate.prompt_logits(ids)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
