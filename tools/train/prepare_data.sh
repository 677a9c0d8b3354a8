#!/usr/bin/env bash
# The training data: the corpus (build_corpus.py, from Debian's python3.11-doc) and the cut tokenizer
# with the tokenized corpus (cut_tokenizer.py) under OUT/corpus and OUT/tok. Needs python3-regex and
# the Qwen3 tokenizer oracle (tests/oracle/setup).
#   tools/train/prepare_data.sh OUT [--vocab N] [--deb FILE.deb]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: prepare_data.sh OUT [--vocab N] [--deb FILE.deb]}
shift
vocab=12288
deb=()
while [ $# -gt 0 ]; do
  case "$1" in
    --vocab) vocab=$2; shift ;;
    --deb) deb=(--deb "$2"); shift ;;
    *) echo "prepare_data.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
python3 "$here/build_corpus.py" --out "$out/corpus" "${deb[@]}"
python3 "$here/cut_tokenizer.py" --corpus "$out/corpus" --out "$out/tok" --vocab "$vocab"
