"""Shared pytest setup: GPU tests (marker ``cuda``) are skipped where no CUDA device exists;
tiny HF checkpoints are built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    # Files holding a test marked ``slow`` go first (the order is otherwise kept): under
    # pytest-xdist's ``--dist loadfile`` the long files then start first rather than finish last.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_home(tmp_path_factory):
    """Keep the default-model cache of the test run out of the user's home."""
    import os

    home = tmp_path_factory.mktemp("bghome")
    old = os.environ.get("BREAKGRAPH_HOME")
    os.environ["BREAKGRAPH_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("BREAKGRAPH_HOME", None)
    else:
        os.environ["BREAKGRAPH_HOME"] = old


@pytest.fixture(scope="session")
def hf_models():
    """``{model_type: transformers model}`` (fp32, eager attention, random weights)."""
    from tiny_models import make_hf_model

    return {mt: make_hf_model(mt) for mt in ("glm_moe_dsa", "deepseek_v32")}


@pytest.fixture(scope="session")
def hf_checkpoints(hf_models, tmp_path_factory):
    """``{model_type: folder}`` of save_pretrained checkpoints (sharded, with index.json)."""
    out = {}
    for mt, model in hf_models.items():
        folder = tmp_path_factory.mktemp(mt)
        model.save_pretrained(folder, max_shard_size="100KB")
        out[mt] = folder
    return out


@pytest.fixture(scope="module")
def interp_results(request):
    """``{check name: "ok" | traceback}``: every ``check_*`` function of the requesting test
    module, run once under Triton's interpreter in a subprocess (skipped without triton)."""
    pytest.importorskip("triton")
    from test_kernels_fp8 import run_checks

    return run_checks(Path(request.module.__file__).stem)



@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for the requesting module (``pytestmark = pytest.mark.usefixtures(...)``):
    the tiny model gains nothing from more, and on a busy machine spinning OpenMP workers slow it
    down many times over. The setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
