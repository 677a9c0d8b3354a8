#!/usr/bin/env bash
# The whole pipeline on CPU, small: model.py against transformers' goldens, a short training run of the
# default preset, moraine-convert (F32) and moraine-quantize (Q4_K experts / Q8_0 rest, the demo's
# types; the file must stay within 10 MB), moraine-run's greedy tokens against model.py's on the F32
# file, and the tokenizer through bpe.py, moraine and llama.cpp.
#   tools/train/smoke.sh BUILD_DIR DATA_DIR OUT_DIR [MINUTES]
# BUILD_DIR has tools/moraine-{convert,quantize,run,tokenize,inspect}; DATA_DIR is prepare_data.sh's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: smoke.sh BUILD_DIR DATA_DIR OUT_DIR [MINUTES]}" && pwd)
data=${2:?DATA_DIR}
out=${3:?OUT_DIR}
minutes=${4:-2}
bin="$build/tools"
mkdir -p "$out"
echo "== test_model.py"
python3 "$here/test_model.py"
echo "== train.py --minutes $minutes (CPU, batch 4 x 128)"
python3 "$here/train.py" --data "$data/tok" --out "$out/train" --device cpu --threads "$(nproc)" \
  --minutes "$minutes" --batch 4 --seq 128 --warmup 20 --calibrate-steps 5 --log-every 10 --eval-every 40 \
  --eval-windows 16
echo "== moraine-convert (f32) and moraine-quantize (q4_k experts, q8_0 rest)"
"$bin/moraine-convert" "$out/train/checkpoint" "$out/model-f32.gguf" --outtype f32
"$bin/moraine-quantize" "$out/model-f32.gguf" "$out/model-q4_k.gguf" --map "_exps.=q4_k" --default q8_0 | tail -n 1
size=$(stat -c %s "$out/model-q4_k.gguf")
echo "model-q4_k.gguf: $size bytes"
[ "$size" -le 10000000 ] || { echo "FAIL: the Q4_K/Q8_0 file is over 10 MB" >&2; exit 1; }
"$bin/moraine-inspect" "$out/model-q4_k.gguf" > "$out/inspect.txt"   # whole: a closed pipe would stop the script
head -n 30 "$out/inspect.txt"
echo "== greedy: moraine-run on the F32 file vs model.py"
python3 "$here/generate.py" --checkpoint "$out/train/checkpoint" -n 24 --json "$out/greedy.json" \
  --moraine-run "$bin/moraine-run" --gguf "$out/model-f32.gguf"
echo "== tokenizer: bpe.py, moraine, llama.cpp"
python3 "$here/check_tokenizer.py" --gguf "$out/model-f32.gguf" --tokenizer "$data/tok" --corpus "$data/corpus" \
  --moraine-tokenize "$bin/moraine-tokenize"
echo "smoke.sh: done"
