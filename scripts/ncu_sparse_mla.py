"""Two launches of the sparse MLA kernel at 8 heads on an 8192-token prefill (no dense path, so
every launch is the sparse kernel alone), for ``ncu -k regex:_sparse_mla_fwd --launch-count 2``:
first the loop that walks position → page → row itself (``slots=False``), then the default.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --csv -k regex:_sparse_mla_fwd \\
        --launch-count 2 python scripts/ncu_sparse_mla.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_kernels_attention as bench  # noqa: E402

from breakgraph.kernels.triton_sparse_mla import sparse_mla_attention_triton  # noqa: E402

WALKING = dict(slots=False)


def main() -> None:
    (q, kv, tk, batch, out), *_ = bench.mla_case(8, "prefill 8k")
    args = (q, kv, tk, batch["page_table"], batch["token_req"], bench.PAGE, bench.GLM5_SCALE, out)
    for opts in (WALKING, {}):
        sparse_mla_attention_triton(*args, **opts)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
