#!/usr/bin/env bash
# The H200 suite behind README's LM-step table: pt3func rows and, in the same run, the anchor's rows.
#   bash benchmarks/run_h200.sh ANCHOR_SCRIPT OUT_DIR [single|multi|all]
# ANCHOR_SCRIPT is shared/bench/anchor_lm_step.py; each run appends one JSON line to OUT_DIR/lm_step.jsonl.
set -u
anchor=$1; out=$2; which=${3:-all}
mkdir -p "$out"
cd "$(dirname "$0")"
log() { echo "== $*" >&2; }
run() { log "$*"; "$@" 2>"$out/err_$(date +%s%N).log" | grep '^{' | tee -a "$out/lm_step.jsonl"; }
if [ "$which" != multi ]; then
  run python lm_step.py --out "$out/pt3func.jsonl"
  run python lm_step.py --no-donate --out "$out/pt3func.jsonl"
  run python "$anchor" torch-compile
fi
if [ "$which" != single ] && [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run torchrun --standalone --nproc-per-node 2 lm_step.py --sharding dp --out "$out/pt3func.jsonl"
  run torchrun --standalone --nproc-per-node 2 lm_step.py --sharding fsdp --out "$out/pt3func.jsonl"
  run torchrun --standalone --nproc-per-node 2 "$anchor" torch-ddp-compile
fi
