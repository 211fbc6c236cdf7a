"""load_format="dummy": random weights in a checkpoint's shape, from config.json alone."""

from __future__ import annotations

import shutil

import pytest

from pagedcore import LLM, SamplingParams
from test_gpu_path import add_toy_tokenizer
from test_models_hf import make_checkpoint, prompts


def test_dummy_weights_need_only_the_config(tmp_path) -> None:
    path = make_checkpoint("llama", tmp_path)
    add_toy_tokenizer(path, 384)
    for f in path.glob("*.safetensors"):
        f.unlink()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    ps = [{"prompt_token_ids": p} for p in prompts()]

    def run(seed: int) -> list[list[int]]:
        llm = LLM(model=str(path), device="cpu", dtype="float32", load_format="dummy", seed=seed, num_kv_blocks=64)
        outs = llm.generate(ps, params, use_tqdm=False)
        for o in outs:
            assert len(o.outputs[0].token_ids) == 8
            assert all(lp[t].logprob > -1e9 for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids))
        return [o.outputs[0].token_ids for o in outs]

    assert run(0) == run(0)  # seeded
    with pytest.raises(ValueError, match="load_format must be 'auto', 'safetensors' or 'dummy', got 'pt'"):
        LLM(model=str(path), device="cpu", load_format="pt")
    shutil.rmtree(path)
