"""A tiny, deterministic causal LM that both vLLM and transformers load: for rollout tests.

``build_tiny_lm(directory, data_file)`` trains a byte-level BPE tokenizer (``VOCAB_SIZE`` entries) on
MATH training text, wraps it as a transformers fast tokenizer (``<|endoftext|>`` is eos and pad),
builds a seeded random-weight ``Qwen2ForCausalLM`` (tied embeddings, hidden 64, 2 layers, head_dim
32) and saves both (safetensors) to ``directory``. About 3 s on one core.

Random weights babble, and a babbling model never writes ``</answer>``. So the model is *planted*
with a cycle: the most likely next token after ``LOOP[i]`` is ``LOOP[i+1]`` (cyclically) and after
any other token ``LOOP[0]``, where ``LOOP`` are the tokens of ``LOOP_TEXT`` = " the answer is
</answer>" (``</answer>`` alone is five BPE tokens, so stop strings really span tokens). Greedy
decoding therefore writes `` the answer is </answer> the answer is </answer> ...`` from any prompt;
at temperature 1 each planted step has p ≈ 0.75, so samples differ with the seed and most reach
``</answer>`` within ~60 tokens. ``plant_eos_after_stop`` rewires a copy so that EOS follows
``</answer>``: the push-weights tests use it to make the pushed policy's output visibly different.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 1024
EOS = "<|endoftext|>"
STOP = "</answer>"
LOOP_TEXT = " the answer is </answer>"  # the biased cycle (several BPE tokens; STOP spans five)
HIDDEN = 64
STRENGTH = 1.0  # loop-token embedding norm: next-loop-token logit ≈ 8·STRENGTH (see build_model)
DEFAULT_DIM = 40  # residual coordinate that marks "not a loop token"
DEFAULT_BUMP = 0.1
EOS_DIM = 50  # residual coordinate plant_eos_after_stop gives the EOS token


def _math_text(data_file: Path, limit: int = 1500) -> list[str]:
    texts = []
    with open(data_file) as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            row = json.loads(line)
            texts.append(row["problem"])
            texts.append(row["solution"])
    return texts


def build_tokenizer(data_file: Path):
    """A byte-level BPE (``VOCAB_SIZE`` entries) trained on MATH text, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_math_text(data_file), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def loop_token_ids(tokenizer) -> list[int]:
    """Token ids of ``LOOP_TEXT`` (all distinct): the cycle the model is biased to walk."""
    ids = tokenizer.encode(LOOP_TEXT, add_special_tokens=False)
    if len(set(ids)) != len(ids) or tokenizer.decode(ids) != LOOP_TEXT:
        raise AssertionError(f"LOOP_TEXT must tokenize into distinct, round-tripping tokens: {ids}")
    return ids


def build_model(tokenizer, seed: int = 0, strength: float = STRENGTH, heads: int = 2):
    """Seeded tiny Qwen2 (fp32, eval mode) with the loop bias described in the module docstring.

    How the bias is planted: loop token ``i`` has embedding ``strength·e_i`` (a one-hot direction),
    every other token a small random embedding plus ``DEFAULT_BUMP`` in coordinate ``DEFAULT_DIM``.
    The last layer's MLP is replaced by a planted map: unit ``i`` reads direction ``e_i`` and writes
    ``e_{i+1}`` (cyclically); unit ``DEFAULT_DIM`` reads the default coordinate and writes ``e_0``.
    After the final norm the residual points along the next loop token's embedding, so (tied head)
    its logit is about ``8·strength`` against ~0 for the rest of the vocabulary.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    loop = loop_token_ids(tokenizer)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,  # 2: head_dim 32 (vLLM's CPU attention needs a multiple of 32); 1: 64 (FA3 on CUDA)
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).eval()
    k = len(loop)
    assert DEFAULT_DIM >= k
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # (V, H), tied with lm_head
        emb[:, :k] = 0.0
        emb[:, DEFAULT_DIM] = DEFAULT_BUMP
        eye = torch.eye(HIDDEN)
        for i, tid in enumerate(loop):
            emb[tid] = eye[i] * strength
        mlp = model.model.layers[-1].mlp
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.zero_()
        for i in range(k):
            mlp.gate_proj.weight[i, i] = 1.0
            mlp.up_proj.weight[i, i] = 1.0
            mlp.down_proj.weight[:, i] = eye[(i + 1) % k]
        mlp.gate_proj.weight[k, DEFAULT_DIM] = 1.0
        mlp.up_proj.weight[k, DEFAULT_DIM] = 1.0
        mlp.down_proj.weight[:, k] = eye[0] * 4.0
    return model


def build_tiny_lm(directory: Path | str, data_file: Path | str, seed: int = 0, heads: int = 2) -> Path:
    """Train the tokenizer, build the model (``heads`` attention heads) and save both to ``directory``
    (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(Path(data_file))
    model = build_model(tokenizer, seed=seed, heads=heads)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@torch.no_grad()
def plant_eos_after_stop(model, tokenizer) -> None:
    """Rewire ``model`` in place so EOS (not ``LOOP[0]``) is the likely token after the last loop token."""
    loop = loop_token_ids(tokenizer)
    eye = torch.eye(HIDDEN)
    model.model.embed_tokens.weight[tokenizer.eos_token_id] = eye[EOS_DIM] * STRENGTH
    model.model.layers[-1].mlp.down_proj.weight[:, len(loop) - 1] = eye[EOS_DIM]


def pushed_variant(model, tokenizer):
    """A copy of ``model`` that decodes visibly otherwise: seeded noise (0.02) on every weight, and EOS planted
    after ``</answer>``; for the weight-push tests."""
    import copy

    pushed = copy.deepcopy(model)
    generator = torch.Generator(device=model.device).manual_seed(0)
    with torch.no_grad():
        for param in pushed.parameters():
            param.add_(torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype) * 0.02)
    plant_eos_after_stop(pushed, tokenizer)
    return pushed
