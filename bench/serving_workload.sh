# The serving benchmark's workload of each shape, sourced by run_serving_gpu.sh and
# run_serving_ab.sh so that both run the same requests. `serving_workload SHAPE` sets
# `base` (bench_serving.py's arguments: requests, prompts, model length, clients),
# `streams` (the disconnect check's streams) and `api` (the HTTP processes of the
# several-process runs); it returns 1 for a shape it does not know.
serving_workload() {
  local shape="$1" flags
  streams=512 api=4
  case "$shape" in
    smollm2)  # 512 requests, own parts ~200 tokens, half behind 4 system prompts of 512; 128 out
      flags=(--num-requests 512 --max-tokens 128 --prompt-len-median 200 --max-num-seqs 512) ;;
    llama3-8b)  # 256 requests, own parts ~300 tokens, half behind 4 system prompts of 512; 256 out
      flags=(--num-requests 256 --max-tokens 256 --prompt-len-median 300 --max-num-seqs 256)
      api=2 ;;
    tiny)  # the scripts' own dry run on a CPU
      flags=(--num-requests 32 --max-tokens 16 --prompt-len-median 64 --max-num-seqs 64 --device cpu
             --dtype float32)
      streams=32 ;;
    *) return 1 ;;
  esac
  # (the GPU shapes' saturation: three runs each side, each ~0.6 s for SmolLM2 on one GPU,
  # whose single runs' online/offline ratios spread 0.77-1.12 at one commit)
  [[ "$shape" != tiny ]] && flags+=(--saturation-repeats 3)
  base=(--shape "$shape" --dtype bfloat16 "${flags[@]}" --max-model-len 2048 --shared-prefix-len 512
        --shared-prefix-fraction 0.5 --num-shared-prefixes 4 --client raw --client-processes 4)
}
