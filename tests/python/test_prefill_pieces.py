"""Prefill and mixed steps through the layer pieces their CUDA graphs capture.

On CUDA, steps that are not pure decode replay one graph per layer boundary
(everything but attention) for a ladder of padded token counts, with attention run
eagerly between them (model_runner.ModelRunner._capture_prefill_graphs). The split
of each layer into the piece before attention and the piece after it, the static
buffers and the padding are the same code on the CPU when the runner is told to run
the pieces eagerly (``run_prefill_in_pieces``): here that path is checked against
transformers on the same weights (the graphs themselves, in tests/python/test_gpu_path.py).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402
from test_models_hf import hf_greedy, make_checkpoint, prompts  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from pagedcore import default_model_path

    return default_model_path()


# llama: q/k/v biases (the qkv GEMM into the static buffer with addmm); qwen3: q/k norm;
# mistral: sliding window.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_prefill_pieces_equal_transformers(arch, tokenizer_dir, tmp_path) -> None:
    path = make_checkpoint(arch, tmp_path)
    # Chunks of up to 48 tokens: every step, prefill chunks, mixed and decode steps, fits
    # a piece size and is padded up to it (40 -> 48, 4 decode rows -> 16).
    llm = LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=256, max_model_len=256,
              max_num_batched_tokens=48)
    runner = llm.llm_engine.runner
    runner.run_prefill_in_pieces((16, 32, 48))
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert runner.prefill_graph_replays >= 16  # every step went through the pieces
    for p, out in zip(ps, outs):
        tokens, ref = hf_greedy(path, p, 16)
        c = out.outputs[0]
        assert c.token_ids == tokens
        ours = torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(tokens)])
        theirs = ref[torch.arange(16), torch.tensor(tokens)]
        assert torch.allclose(ours, theirs, atol=2e-4, rtol=0)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
