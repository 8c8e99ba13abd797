#!/usr/bin/env bash
# Time to a verdict on a GPU machine: pp-smoke-run --local with every stage on GPU 0, cold (a
# fresh HOME: no weight cache, no tinygrad cache, as on a new instance) and then warm, for each
# way of loading the reference (after the request, or beside the stages), alternating.
#
#   bench/verdict_gpu.sh OUT [MODEL.gguf] [pp-smoke-run args...]
#
# MODEL defaults to the llama-3.2-1B shape written by pp-synth-gguf. Each run's JSON report goes
# to OUT/<cold|warm>_<after|beside>.json and its output to the same name with .log;
# LOADS (default "after beside") picks the ways of loading the reference.
set -euo pipefail
out=$1
model=${2:-/tmp/llama1b.gguf}
shift $(( $# >= 2 ? 2 : 1 ))
extra=("$@")
mkdir -p "$out"
[[ -f $model ]] || python3 -m pytest_ppsmoke.stage.synth "$model" --shape llama-3.2-1b
run() {  # NAME HOME LOAD
  echo "== $1" >&2
  HOME=$2 CUDA=1 python3 -m pytest_ppsmoke.harness.cli --local --gpus 0 --model "$model" --max-tokens 64 \
    --reference-load "$3" --report "$out/$1.json" "${extra[@]}" >"$out/$1.log" 2>&1 || echo "$1 failed: $(tail -3 "$out/$1.log")" >&2
}
homes=$(mktemp -d /tmp/verdict-homes.XXXXXX)
loads=${LOADS:-after beside}
for load in $loads; do mkdir -p "$homes/$load"; done
for phase in cold warm; do
  for load in $loads; do
    run "${phase}_$load" "$homes/$load" "$load"
  done
done
rm -rf "$homes"
