# The two commands of the README's quick start:
#   make demo   set up, then run the autobatched SIS demo on the offline default model
#   make test   set up (both venvs), then lint, run every test suite and build the docs
# Both install the locked set that fits the machine (locks/*.txt: the GPU set where an NVIDIA
# driver is; `bash scripts/setup.sh --print-plan` says which and why). For maintainers:
#   make test-latest   the same checks on the newest releases inside pyproject's ranges,
#                      and the gate against vLLM's newest release
#   make gate-vllm     the gate alone: the vLLM backend against the GPU lock's vllm
#                      (locks/gpu.txt), else vLLM's newest release (scripts/vllm_gate.py;
#                      no GPU, no vllm install)
#   make lock          refresh locks/*.txt from those newest releases (the GPU set's too)
#   make lock-gpu      refresh the GPU set's lock alone (resolved from metadata: no GPU)
#   make test-gpu-set  the GPU set's packages that are not CUDA builds, on the CPU: mypy and
#                      the HF and mock test files in .venv-gpu-set (minutes of pip)
.PHONY: demo test test-latest gate-vllm lock lock-gpu test-gpu-set setup

demo:
	bash scripts/setup.sh
	HF_HUB_OFFLINE=1 .venv/bin/python -m genlm.backend sis --prompt "Montreal is" --particles 10 --max-tokens 10

test:
	bash scripts/test.sh

test-latest:
	bash scripts/test.sh --latest

# The vllm release locks/gpu.txt pins (a `vllm==X` line), if any.
GATE_VERSION = $(shell sed -n 's/^vllm==\([^ ;\\]*\).*/\1/p' locks/gpu.txt 2>/dev/null)

gate-vllm:
	bash scripts/setup.sh
	.venv/bin/python scripts/vllm_gate.py $(if $(GATE_VERSION),--version $(GATE_VERSION))

lock:
	bash scripts/lock.sh

lock-gpu:
	bash scripts/lock.sh --gpu

test-gpu-set:
	bash scripts/test_gpu_set.sh

setup:
	bash scripts/setup.sh --vllm
