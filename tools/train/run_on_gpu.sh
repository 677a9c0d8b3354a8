#!/usr/bin/env bash
# The real training run, on the GPU machine (torch 2.x with CUDA; transformers for hf_check.py), from
# the repository root with prepare_data.sh's output carried:
#   tools/train/run_on_gpu.sh DATA_DIR [MINUTES [TRAIN_ARGS...]]   (MINUTES of training, default 8;
#   TRAIN_ARGS go to train.py, e.g. --max-steps 400 --eval-every 50)
# DATA_DIR needs tok/{tokenizer.json,tokenizer_config.json,train.bin,heldout.bin} and
# corpus/{heldout.txt,documents.json}. Leaves under $OUT (at most 8 flat files come back):
#   loss.tsv, train_log.json (steps, tokens, wall time, held-out loss, expert shares), samples.md
#   (transformers' greedy generations), logs.tar (train.log, hf_check.json, gpu.txt, timing.txt) and
#   checkpoint.tar.partNN (the HF checkpoint folder, F32; `cat checkpoint.tar.part* | tar x` gives
#   train/checkpoint). The checkpoint is packed before hf_check.py runs, so a failed check keeps it.
set -euo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
data=$(cd "${1:?usage: run_on_gpu.sh DATA_DIR [MINUTES]}" && pwd)
minutes=${2:-8}
shift $(( $# < 2 ? $# : 2 ))
out=${OUT:?run_on_gpu.sh: \$OUT must name the folder that comes back}
work=$(mktemp -d /tmp/moraine-train.XXXXXX)
started=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$work/gpu.txt" || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$work/gpu.txt" 2>&1 || true
cat "$work/gpu.txt"
python3 "$here/test_model.py" 2>&1 | tee "$work/test_model.log"
train_status=0
python3 "$here/train.py" --data "$data/tok" --out "$work/train" --minutes "$minutes" --device cuda "$@" 2>&1 \
  | tee "$work/train.log" || train_status=$?
trained=$(date +%s)
if [ -f "$work/train/checkpoint/model.safetensors" ]; then
  tar -C "$work" -cf - train/checkpoint | split -b 15M -d - "$out/checkpoint.tar.part"
fi
check_status=0
if [ "$train_status" = 0 ]; then
  timeout 150 python3 "$here/hf_check.py" --checkpoint "$work/train/checkpoint" --heldout "$data/corpus/heldout.txt" \
    --documents "$data/corpus/documents.json" --out "$work/check" 2>&1 | tee "$work/hf_check.log" || check_status=$?
fi
finished=$(date +%s)
printf 'training loop and setup: %d s\nhf_check: %d s\ntotal: %d s\ntrain status %d, hf_check status %d\n' \
  $((trained - started)) $((finished - trained)) $((finished - started)) "$train_status" "$check_status" | tee "$work/timing.txt"
for f in train/loss.tsv train/train_log.json check/samples.md; do
  [ -f "$work/$f" ] && cp "$work/$f" "$out/"
done
(cd "$work" && tar -cf "$out/logs.tar" $(ls train.log test_model.log hf_check.log check/hf_check.json gpu.txt timing.txt 2>/dev/null))
[ "$train_status" = 0 ] && [ "$check_status" = 0 ]
