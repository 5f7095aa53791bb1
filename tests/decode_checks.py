"""The static-KV-cache decoder's check, shared by its tests and the attention benchmark's: a tiny model of each
architecture it supports, and its left-padded prefill and decode against the model's own forward."""

import torch

from a5core.engines.static_decode import StaticKVDecoder


def tiny_decoder_model(model_type: str):
    """A 2-layer model of ``model_type`` (qwen2, llama, mistral) over 61 token ids, random weights, seeded."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_class, model_class = classes[model_type]
    extra = {"sliding_window": None} if model_type == "mistral" else {}
    return model_class(config_class(**kwargs, **extra)).eval()


def check_left_padded_decode(model, narrow_every_other: bool = False) -> None:
    """Three prompts left-padded to 5, prefilled, then 4 decode steps attending the whole cache (or, with
    ``narrow_every_other``, every other step only its filled columns): each row's logits are its own unpadded
    forward's."""
    torch.manual_seed(1)
    lengths = [5, 3, 1]  # left-padded to 5
    prompt = torch.randint(0, 61, (3, 5))
    valid = torch.arange(5)[None, :] >= (5 - torch.tensor(lengths))[:, None]
    continuation = torch.randint(0, 61, (3, 4))
    decoder = StaticKVDecoder(model, batch_size=3, capacity=12)
    attend = torch.zeros(3, 12, dtype=torch.bool)
    attend[:, :5] = valid
    steps = [decoder.prefill(prompt, valid)]
    for t in range(4):
        attend[:, 5 + t] = True
        window = 5 + t + 1 if narrow_every_other and t % 2 else 12  # the filled columns, or the whole cache
        steps.append(decoder.decode(continuation[:, t], valid.sum(-1) + t, 5 + t, attend[:, :window]))
    for row, n in enumerate(lengths):  # each row alone, unpadded, through the model's own forward
        ids = torch.cat([prompt[row, 5 - n :], continuation[row]])[None]
        with torch.no_grad():
            want = model(ids).logits[0, n - 1 :].float()
        got = torch.stack([step[row] for step in steps])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
