"""Half-precision generation against float32 transformers over many decode steps.

A bfloat16 (or float16) run may pick a different greedy token than float32 where
two candidates are nearly tied, after which the two texts differ while both are
right. So each run is checked along its own path: transformers in float32 scores
the run's prompt + output in one forward, and at every step we compare the run's
logprob of the token it chose with float32's, and that token's float32 logprob
with float32's best (a near-tie, never a wrong token). How far is fine is measured,
not guessed: transformers itself, in the run's dtype and on the same path, deviates
from its float32 by some amount; pagedcore may deviate by at most 1.5x that (+ a
little), in the worst step and on average. A cache write, a rotary position or a
decode-attention read that goes wrong after the first token moves logprobs by whole
nats.

The same check runs on the GPU (tests/python/test_gpu_path.py), there also for the
fp8 (e4m3) KV cache, whose references round K and V to e4m3 inside transformers'
attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402
from test_models_hf import make_checkpoint, prompts  # noqa: E402


def _fp8_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention reading K and V rounded to e4m3 (scale 1,
    saturated at +-448) as pagedcore's fp8 cache stores them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def e4m3(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(t.dtype)

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, e4m3(key), e4m3(value), attention_mask, **kwargs)


def reference_logprobs(path: Path, sequences: list[list[int]], device: str, dtype: torch.dtype,
                       fp8_kv: bool = False) -> list[torch.Tensor]:
    """transformers' float32 log-softmax ``[len(seq), vocab]`` at every position,
    the model run in ``dtype``."""
    kw = {}
    if fp8_kv:
        transformers.AttentionInterface.register("pagedcore_fp8_kv", _fp8_attention)
        kw["attn_implementation"] = "pagedcore_fp8_kv"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device)
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq], device=device)).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    del model
    return out


def assert_tracks_float32(llm: LLM, path: Path, ps: list[list[int]], steps: int, device: str,
                          fp8_kv: bool = False) -> None:
    """Greedy ``steps`` tokens of ``llm`` stay as close to float32 transformers at
    every step as transformers in ``llm``'s dtype does (see the module docstring)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    completions = [o.outputs[0] for o in outs]
    assert all(len(c.token_ids) == steps for c in completions)
    seqs = [p + list(c.token_ids) for p, c in zip(ps, completions)]
    ref = reference_logprobs(path, seqs, device, torch.float32, fp8_kv)
    peer = reference_logprobs(path, seqs, device, llm.llm_engine.model.dtype, fp8_kv)
    ours_err, peer_err = [], []
    for p, c, r, q in zip(ps, completions, ref, peer):
        for i, token in enumerate(c.token_ids):
            row = r[len(p) - 1 + i]  # the logits that chose output token i
            ours = c.logprobs[i][token].logprob
            ours_err.append(max(abs(ours - row[token].item()), row.max().item() - row[token].item()))
            # NOTE: measured as ours is: the logprob's error, or the float32 regret of the
            # token it would choose at that position (e4m3 rounding flips near-ties).
            qrow = q[len(p) - 1 + i]
            peer_err.append(max(abs(qrow[token].item() - row[token].item()),
                                row.max().item() - row[int(qrow.argmax())].item()))
    ours_err, peer_err = torch.tensor(ours_err), torch.tensor(peer_err)
    worst = int(ours_err.argmax())
    print(f"deviation from float32 over {steps} steps: pagedcore max {ours_err.max():.4f} mean "
          f"{ours_err.mean():.4f}; transformers in the same dtype max {peer_err.max():.4f} mean {peer_err.mean():.4f}")
    assert ours_err.max() <= 1.5 * peer_err.max() + 0.02, (
        f"output token {worst % steps} of prompt {worst // steps} deviates from float32 by "
        f"{ours_err.max():.4f} nats; transformers in the same dtype by at most {peer_err.max():.4f}")
    assert ours_err.mean() <= 1.5 * peer_err.mean() + 0.005


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("half"))


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from pagedcore import default_model_path

    return default_model_path()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_decode_tracks_float32_over_many_steps_on_cpu(tiny, tokenizer_dir, dtype) -> None:
    llm = LLM(model=str(tiny), tokenizer=tokenizer_dir, device="cpu", dtype=dtype, num_kv_blocks=64,
              max_model_len=256)
    assert_tracks_float32(llm, tiny, prompts(), steps=40, device="cpu")
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
