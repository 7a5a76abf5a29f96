"""CPU graph backend: recorded ops replay into the same tensors; host syncs are refused by name."""

from __future__ import annotations

import pytest
import torch

from breakgraph.graphs import CpuGraph, HostSyncInGraphError, cpu_graph


def _capture(fn, *args):
    g = CpuGraph()
    with cpu_graph(g):
        out = fn(*args)
    return g, out


def test_replay_writes_new_results_into_the_captured_output_tensors():
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(4, 8)

    def body(x):
        return ((x @ w).relu() + 1).softmax(-1)

    g, out = _capture(body, x)
    ptr = out.data_ptr()
    for _ in range(3):
        x.copy_(torch.randn(4, 8))
        g.replay()
        assert out.data_ptr() == ptr
        torch.testing.assert_close(out, body(x))


def test_in_place_ops_and_views_mutate_the_same_buffers_at_replay():
    buf = torch.zeros(4, 6)
    x = torch.zeros(4, 6)

    def body():
        left = buf[:, :3]  # view: not re-run, keeps pointing at buf
        buf.copy_(x)
        left.mul_(10)
        buf.t().add_(1)  # in-place through a transposed view

    g, _ = _capture(body)
    for v in (1.0, 2.0):
        x.fill_(v)
        buf.fill_(-99)
        g.replay()
        expected = x.clone()
        expected[:, :3] *= 10
        expected += 1
        torch.testing.assert_close(buf, expected)


def test_python_values_are_frozen_at_capture_like_a_cuda_graph():
    x = torch.arange(8.0)
    n = 3

    def body():
        return x[:n].sum(0, keepdim=True) * 2

    g, out = _capture(body)
    n = 5  # a replay must not see this
    x.fill_(1.0)
    g.replay()
    assert out.item() == 6.0  # still three elements


def test_a_view_op_that_copies_is_replayed_like_a_kernel():
    # Under inference_mode aten.reshape reaches the recorder whole; on a transposed input it copies.
    with torch.inference_mode():
        x = torch.randn(4, 6)
        g, out = _capture(lambda: x.t().reshape(-1))
        assert g.kernels == 1
        x.copy_(torch.randn(4, 6))
        g.replay()
        torch.testing.assert_close(out, x.t().reshape(-1))


def test_kernel_count_ignores_views_and_allocations():
    x = torch.randn(4, 4)

    def body():
        y = torch.empty(4, 4)
        v = x.view(16).view(4, 4).t()
        y.copy_(v)
        return y + 1

    g, _ = _capture(body)
    assert g.kernels == 2
    assert g.op_names == ("aten.copy_.default", "aten.add.Tensor")
    assert not g.empty


def test_capture_with_views_only_is_empty():
    x = torch.randn(4, 4)
    g, _ = _capture(lambda: x.view(16)[:4])
    assert g.empty and g.kernels == 0


@pytest.mark.parametrize(
    ("name", "fn", "expected"),
    [
        ("item", lambda x: x.sum().item(), "Tensor.item()"),
        ("tolist", lambda x: x.tolist(), "Tensor.tolist()"),
        ("bool", lambda x: bool(x[0] > 0), "Tensor.__bool__()"),
        ("python if", lambda x: 1 if (x.sum() > 0) else 0, "Tensor.__bool__()"),
        ("int", lambda x: int(x[0]), "Tensor.__int__()"),
        ("cpu", lambda x: x.cpu(), "Tensor.cpu()"),
        ("to cpu", lambda x: x.to("cpu"), "Tensor.to('cpu')"),
        ("numpy", lambda x: x.numpy(), "Tensor.numpy()"),
        ("nonzero", lambda x: x.nonzero(), "aten.nonzero"),
        ("masked_select", lambda x: x.masked_select(x > 0), "aten.masked_select"),
        ("unique", lambda x: torch.unique(x), "aten._unique2"),
        ("bool mask index", lambda x: x[x > 0], "aten.index.Tensor"),
        ("bool mask write", lambda x: x.__setitem__(x > 0, 0.0), "aten.index_put_"),
        (
            "repeat_interleave",
            lambda x: x.repeat_interleave(torch.ones(4, dtype=torch.long)),
            "repeat_interleave",
        ),
        ("equal", lambda x: torch.equal(x, x), "aten.equal"),
    ],
)
def test_host_sync_in_a_segment_names_the_op_and_the_line(name, fn, expected):
    x = torch.randn(4)
    g = CpuGraph()
    with pytest.raises(HostSyncInGraphError) as info, cpu_graph(g, label="segment 7"):
        fn(x)
    message = str(info.value)
    assert expected in message
    assert "segment 7" in message
    assert "test_graphs_cpu_backend.py" in message  # the Python line of the offending call


def test_graph_safe_forms_of_those_ops_are_accepted():
    x = torch.randn(4)
    idx = torch.tensor([0, 2])

    def body():
        a = x[idx]  # integer indexing: static shape
        b = x.repeat_interleave(2)  # int repeats
        c = x.repeat_interleave(torch.full((4,), 2), output_size=8)  # static output size
        d = torch.where(x > 0, x, torch.zeros_like(x))
        return a.sum() + b.sum() + c.sum() + d.sum()

    g, out = _capture(body)
    x.copy_(torch.randn(4))
    g.replay()
    torch.testing.assert_close(out, body())


def test_recording_stops_after_capture_end():
    x = torch.randn(4)
    g, out = _capture(lambda: x + 1)
    (x * 2).sum().item()  # a host sync: raises HostSyncInGraphError while the guard is on
    after = x * 3  # run after the capture: not recorded
    before = after.clone()
    x.copy_(torch.randn(4))
    g.replay()
    torch.testing.assert_close(out, x + 1)
    assert torch.equal(after, before), "an op run after the capture was replayed"
    assert g.kernels == 1
