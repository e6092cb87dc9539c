"""Shared fixtures: tiny random checkpoints, engines run in-process, and real
tritonserver processes on free ports."""
from __future__ import annotations

import os

# Triton kernels run in the numpy interpreter on a machine without a GPU; the
# choice is made when triton is first imported, so it is made here, first.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# Engines whose device is `auto` run on the CPU in fp32 (the references' precision) on any
# machine, a GPU box included; CUDA tests ask for cuda themselves. TANDEM_DEVICE=cuda runs
# the suite's engines on the GPU instead.
os.environ.setdefault("TANDEM_DEVICE", "cpu")

import pytest  # noqa: E402

from tests.checkpoints import make_checkpoint  # noqa: E402
from client.triton_server import DEFAULT_MODEL, TritonServer  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch) -> directory of a tiny random HF checkpoint (cached per session)."""
    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in cache:
            cache[arch] = make_checkpoint(arch, str(tmp_path_factory.mktemp(arch)))
        return cache[arch]
    return make


@pytest.fixture(scope="module")
def colocated(checkpoint):
    """The colocated engine on the tiny llama: what the disaggregated paths must equal."""
    from tests.engine_utils import small_engine
    engine = small_engine(checkpoint("llama"))
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def default_model() -> str:
    if not os.path.exists(os.path.join(DEFAULT_MODEL, "config.json")):
        pytest.fail(f"the default model is missing at {DEFAULT_MODEL}: run `make setup`")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def llm_server(default_model, tmp_path_factory):
    """One real tritonserver with the `llm` model on the default checkpoint."""
    server = TritonServer(str(tmp_path_factory.mktemp("repo_llm")), models=["llm"],
                          parameters={"llm": {"max_context": "1024", "num_pages": "512"}})
    with server:
        yield server
