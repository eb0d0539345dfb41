# The two commands of the README's quick start:
#   make demo   set up, then run the autobatched SIS demo on the offline default model
#   make test   set up (both venvs), then lint, run every test suite and build the docs
.PHONY: demo test setup lint docs

demo:
	bash scripts/setup.sh
	HF_HUB_OFFLINE=1 .venv/bin/python -m genlm.backend sis --prompt "Montreal is" --particles 10 --max-tokens 10

test:
	bash scripts/test.sh

setup:
	bash scripts/setup.sh --vllm
