"""Tokenisation, log-probs, entropy and the two micro-batch train steps."""

import pytest
import torch

from a5core import (
    get_response_log_probs,
    grpo_microbatch_train_step,
    load_policy,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)
from a5core.policy.causal_lm import output_ids, token_entropy, token_log_probs


def test_tokenize_prompt_and_output_with_the_qwen_tokenizer(qwen_tokenizer):
    prompts = ["Hello", "What is 1+1?"]
    outputs = [" world </answer>", " 2"]
    batch = tokenize_prompt_and_output(prompts, outputs, qwen_tokenizer)
    ids = [
        qwen_tokenizer(p, add_special_tokens=False)["input_ids"]
        + qwen_tokenizer(o, add_special_tokens=False)["input_ids"]
        for p, o in zip(prompts, outputs, strict=True)
    ]
    p_len = [len(qwen_tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    width = max(map(len, ids))
    padded = torch.tensor([row + [151643] * (width - len(row)) for row in ids])  # pad = <|endoftext|>
    assert torch.equal(batch["input_ids"], padded[:, :-1])
    assert torch.equal(batch["labels"], padded[:, 1:])
    assert batch["response_mask"].dtype == torch.bool
    for row in range(2):
        expected = [p_len[row] - 1 <= t < len(ids[row]) - 1 for t in range(width - 1)]
        assert batch["response_mask"][row].tolist() == expected
    # The masked labels are exactly the output's tokens.
    assert (
        batch["labels"][0][batch["response_mask"][0]].tolist()
        == qwen_tokenizer(outputs[0], add_special_tokens=False)["input_ids"]
    )


def test_append_eos_ends_each_output_with_eos_in_the_loss(qwen_tokenizer):
    prompts, outputs = ["Hello", "What is 1+1?"], [" world </answer>", " 2"]
    plain = tokenize_prompt_and_output(prompts, outputs, qwen_tokenizer)
    ended = tokenize_prompt_and_output(prompts, outputs, qwen_tokenizer, append_eos=True)
    eos = qwen_tokenizer.eos_token_id
    for row, output in enumerate(outputs):
        ids = qwen_tokenizer(output, add_special_tokens=False)["input_ids"]
        assert plain["labels"][row][plain["response_mask"][row]].tolist() == ids  # the default: no EOS
        assert ended["labels"][row][ended["response_mask"][row]].tolist() == [*ids, eos]
        last = int(ended["response_mask"][row].nonzero().max())  # the last response label is EOS, in the mask
        assert ended["labels"][row][last] == eos and ended["response_mask"][row][last]
    assert ended["input_ids"].shape[1] == plain["input_ids"].shape[1] + 1
    assert output_ids(outputs, qwen_tokenizer, append_eos=True) == [
        [*qwen_tokenizer(o, add_special_tokens=False)["input_ids"], eos] for o in outputs
    ]


def test_append_eos_with_a_tokenizer_without_eos_is_refused(qwen_tokenizer):
    class NoEos:  # a tokenizer with a pad token but no EOS token
        pad_token_id, eos_token_id = 0, None

        def __call__(self, texts, add_special_tokens):
            return qwen_tokenizer(texts, add_special_tokens=add_special_tokens)

    assert tokenize_prompt_and_output(["a"], [" b"], NoEos())["response_mask"].sum() == 1
    with pytest.raises(ValueError, match="append_eos: the tokenizer has no EOS token"):
        tokenize_prompt_and_output(["a"], [" b"], NoEos(), append_eos=True)


def reference_log_probs(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def reference_entropy(logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_log_probs_and_entropy_equal_the_reference(chunk):
    torch.manual_seed(0)
    logits = (torch.randn(3, 11, 97) * 5).requires_grad_()
    labels = torch.randint(0, 97, (3, 11))
    fast = token_log_probs(logits, labels, chunk_tokens=chunk)
    ref = reference_log_probs(logits, labels)
    assert torch.allclose(fast, ref, atol=1e-5)
    weights = torch.randn(3, 11)
    (grad_fast,) = torch.autograd.grad((fast * weights).sum(), logits)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert torch.allclose(grad_fast, grad_ref, atol=1e-6)
    entropy = token_entropy(logits, chunk_tokens=chunk)
    assert not entropy.requires_grad and torch.allclose(entropy, reference_entropy(logits), atol=1e-4)


def test_chunked_log_probs_of_bf16_logits_are_computed_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 300).bfloat16()
    labels = torch.randint(0, 300, (2, 5))
    out = token_log_probs(logits, labels, chunk_tokens=3)
    assert out.dtype == torch.float32 and torch.allclose(out, reference_log_probs(logits, labels), atol=1e-5)


def test_get_response_log_probs_matches_the_model(tiny_model):
    torch.manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 9))
    labels = torch.randint(0, 64, (2, 9))
    out = get_response_log_probs(tiny_model, input_ids, labels, return_token_entropy=True)
    logits = tiny_model(input_ids).logits
    assert out["log_probs"].shape == (2, 9) and out["token_entropy"].shape == (2, 9)
    assert torch.allclose(out["log_probs"], reference_log_probs(logits, labels), atol=1e-5)
    assert torch.allclose(out["token_entropy"], reference_entropy(logits), atol=1e-5)
    assert "token_entropy" not in get_response_log_probs(tiny_model, input_ids, labels)


MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_sft_microbatch_train_step_loss_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]], requires_grad=True)
    loss, meta = sft_microbatch_train_step(logp, MASK, gradient_accumulation_steps=2, normalize_constant=4.0)
    # per sequence: -(−3)/4 = 0.75 and 3/4 = 0.75 → mean 0.75 → /2
    assert loss.item() == pytest.approx(0.375)
    # d loss / d logp = −mask / (constant · B · ga)
    assert torch.allclose(logp.grad, -MASK.float() / (4.0 * 2 * 2))
    assert meta["response_tokens"].item() == 3


def accumulated_grads(model, batch, n_micro, step):
    model.zero_grad()
    size = batch["input_ids"].shape[0] // n_micro
    for i in range(n_micro):
        part = {k: v[i * size : (i + 1) * size] for k, v in batch.items()}
        logp = get_response_log_probs(model, part["input_ids"], part["labels"])["log_probs"]
        step(logp, part, n_micro)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_gradient_accumulation_invariance(tiny_model, kind):
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (8, 13))
    mask = torch.rand(8, 12) < 0.7
    mask[:, 0] = True
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": mask, "advantages": torch.randn(8, 1)}

    def step(logp, part, ga):
        if kind == "sft":
            sft_microbatch_train_step(logp, part["response_mask"], ga, normalize_constant=5.0)
        else:
            grpo_microbatch_train_step(
                logp, part["response_mask"], ga, "reinforce_with_baseline", advantages=part["advantages"]
            )

    whole = accumulated_grads(tiny_model, batch, 1, step)
    split = accumulated_grads(tiny_model, batch, 4, step)
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_load_policy_rejects_missing_local_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(str(tmp_path / "no-model"))


def test_load_policy_from_a_local_directory(tiny_model, tmp_path, qwen_tokenizer):
    tiny_model.save_pretrained(tmp_path)
    qwen_tokenizer.save_pretrained(tmp_path)
    model, tokenizer = load_policy(str(tmp_path))
    assert model.config.vocab_size == 64 and tokenizer.eos_token_id == 151643
