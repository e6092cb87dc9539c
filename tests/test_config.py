"""Configuration: config.pbtxt parameters -> frozen configs, and the committed
configs are exactly what scripts/gen_config.py makes from the code."""
import os
import subprocess
import sys

import pytest
import torch

from backends.config import EngineConfig
from backends.disagg.config import DisaggConfig
from client.triton_server import ROOT


def test_parameters_are_typed_and_blank_keeps_default(monkeypatch):
    monkeypatch.delenv("TANDEM_MODEL_PATH", raising=False)
    cfg = EngineConfig.from_params({"page_size": "8", "kv_memory_gb": "0.5", "model_path": "", "nixl_port": "1"})
    assert (cfg.page_size, cfg.kv_memory_gb) == (8, 0.5) and cfg.model_path == EngineConfig().model_path


def test_environment_overrides_model_path(monkeypatch):
    monkeypatch.setenv("TANDEM_MODEL_PATH", "/models/other")
    assert EngineConfig.from_params({"model_path": "/models/mine"}).model_path == "/models/other"


def test_step_budget_is_per_device_unless_set():
    assert EngineConfig(device="cpu").step_budget(decodes=0) == 128
    assert EngineConfig(device="cpu").step_budget(decodes=8) == 136  # 128 prompt tokens beside the decodes
    assert EngineConfig(device="cuda").step_budget(decodes=8) == 2048
    assert EngineConfig(device="cuda", max_running_requests=4096).step_budget(decodes=0) == 4096  # every decode fits
    assert EngineConfig(device="cpu", max_batch_tokens=300).step_budget(decodes=8) == 300


@pytest.mark.parametrize("bad", [{"role": "trainer"}, {"page_size": 0}, {"chunk_size": -1}, {"max_batch_tokens": -1},
                                 {"dp_size": 0}, {"dp_size": -2}])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)
    with pytest.raises(ValueError, match="dtype"):
        _ = EngineConfig(dtype="float8").torch_dtype


def test_dp_size_is_at_most_one_rank_per_core():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"dp_size {cores + 1} is more ranks than the {cores} cores"):
        EngineConfig(device="cpu", dp_size=cores + 1)
    with pytest.raises(ValueError, match="dp_size 2 is more ranks than the 1 cores"):
        EngineConfig(device="cpu", dp_size=2, cpu_cores="0")
    cfg = EngineConfig(device="cpu", dp_size=2, cpu_cores="0-1", threads=4)
    assert [(c.cpu_cores, c.threads, c.dp_size) for c in (cfg.for_rank(0), cfg.for_rank(1))] == [("0", 2, 1), ("1", 2, 1)]


def test_disagg_parameters():
    cfg = DisaggConfig.from_params({"prefill_address": "10.0.0.2:9000", "pipeline": "off", "pipeline_min_iters": "2"})
    assert cfg.prefill_host_port == ("10.0.0.2", 9000) and cfg.pipeline == "off"
    with pytest.raises(ValueError):
        DisaggConfig(pipeline="sometimes")
    with pytest.raises(ValueError):
        _ = DisaggConfig(prefill_address="nohost").prefill_host_port


def test_committed_configs_match_the_code(tmp_path):
    repo = os.path.join(ROOT, "model_repository")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_config.py"), str(tmp_path)], check=True)
    for model in ("llm", "prefill", "decode", "router"):
        with open(os.path.join(repo, model, "config.pbtxt")) as committed, \
                open(tmp_path / model / "config.pbtxt") as generated:
            assert committed.read() == generated.read(), f"{model}: run `make configs` and commit the result"


def test_readme_lists_every_engine_parameter_with_its_default():
    from backends.config import parameter_table
    with open(os.path.join(ROOT, "README.md")) as f:
        assert parameter_table() in f.read(), "paste `python -m backends.config` into the README"


def test_bad_parameter_values_name_the_parameter():
    with pytest.raises(ValueError, match="parameter 'page_size' must be an int, got 'sixteen'"):
        EngineConfig.from_params({"page_size": "sixteen"})
    with pytest.raises(ValueError, match="parameter 'kv_memory_gb' must be a float"):
        EngineConfig.from_params({"kv_memory_gb": "lots"})
    with pytest.raises(ValueError, match="stream_backlog must be >= 0, got -1"):
        EngineConfig.from_params({"stream_backlog": "-1"})


@pytest.mark.server
@pytest.mark.parametrize("model, params, message", [
    ("llm", {"page_sise": "8"}, "llm: unknown parameter 'page_sise' in config.pbtxt"),
    ("llm", {"nixl_port": "1"}, "llm: unknown parameter 'nixl_port'"),   # a hand-off knob on the colocated model
    ("llm", {"threads": "two"}, "parameter 'threads' must be an int, got 'two'"),
    ("llm", {"dp_size": "0"}, "dp_size must be >= 1, got 0"),
    ("decode", {"dp_size": "64", "prefill_address": "127.0.0.1:1"}, "dp_size 64 is more ranks than the"),
])
def test_tritonserver_refuses_a_bad_or_unknown_parameter_at_load(tmp_path, model, params, message):
    from client.triton_server import TritonServer
    server = TritonServer(str(tmp_path), models=[model], parameters={model: params}, ready_timeout_s=120)
    with pytest.raises(RuntimeError) as failed:
        server.start()
    server.stop()
    with open(server.log_path) as f:
        assert message in f.read(), failed.value


@pytest.mark.server
@pytest.mark.parametrize("parameters, message", [
    ({"prefil_url": "x:1"}, "router: unknown parameter 'prefil_url' in config.pbtxt"),
    ({"token_channel": "maybe"}, "parameter 'token_channel' must be true or false, got 'maybe'"),
    ({"prefill_endpoints": "local,,h:1"}, "prefill_endpoints: entry 2 of 'local,,h:1' is empty"),
    ({"decode_endpoints": "h:port"}, "decode_endpoints: 'h:port' is neither `local` nor host:port"),
    ({"prefill_policy": "random"}, "prefill_policy must be cache_aware or least_load or round_robin, got 'random'"),
    ({"unhealthy_after": "0"}, "unhealthy_after must be >= 1, got 0"),
])
def test_router_refuses_a_bad_parameter_at_load(tmp_path, parameters, message):
    from client.triton_server import TritonServer
    server = TritonServer(str(tmp_path), models=["router"], parameters={"router": parameters}, ready_timeout_s=120)
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    with open(server.log_path) as f:
        assert message in f.read()


def test_tandem_device_pins_auto_and_an_explicit_device_wins(monkeypatch):
    from backends.config import EngineConfig
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")
    assert EngineConfig().torch_device.type == "cpu" and EngineConfig().torch_dtype == torch.float32
    monkeypatch.setenv("TANDEM_DEVICE", "cuda")
    assert EngineConfig().torch_device.type == "cuda" and EngineConfig().torch_dtype == torch.bfloat16
    assert EngineConfig(device="cpu").torch_device.type == "cpu"


def test_tandem_dtype_pins_auto_and_a_bad_one_is_refused_naming_it(monkeypatch):
    from backends.config import EngineConfig
    monkeypatch.setenv("TANDEM_DEVICE", "cuda")
    monkeypatch.setenv("TANDEM_DTYPE", "float32")
    assert EngineConfig().torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16
    monkeypatch.setenv("TANDEM_DTYPE", "fp8")
    with pytest.raises(ValueError, match="TANDEM_DTYPE.*'fp8'"):
        EngineConfig().torch_dtype
