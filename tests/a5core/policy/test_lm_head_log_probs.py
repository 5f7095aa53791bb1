"""The fused LM-head log-softmax equals the plain formulas: values, entropy and gradients."""

import pytest
import torch

from a5core.policy.causal_lm import get_response_log_probs, token_log_probs
from a5core.policy.lm_head_log_probs import linear_log_probs
from a5core.policy.losses import compute_entropy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(hidden, weight, labels):
    logits = (hidden @ weight.T).float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    return log_probs, compute_entropy(logits.detach())


@pytest.mark.parametrize("chunk_tokens", [1, 7, 24, 4096])
def test_values_entropy_and_gradients_match_the_plain_log_softmax(chunk_tokens):
    torch.manual_seed(0)
    hidden = (3 * torch.randn(2, 12, 16, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 12))
    upstream = torch.randn(2, 12, dtype=torch.float64)

    want, want_entropy = reference(hidden, weight, labels)
    (want.double() * upstream).sum().backward()
    want_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got, entropy = linear_log_probs(hidden, weight, labels, with_entropy=True, chunk_tokens=chunk_tokens)
    (got.double() * upstream).sum().backward()
    assert got.dtype == torch.float32 and got.shape == labels.shape and not entropy.requires_grad
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=2e-5)  # fp32 lse − Σp·z cancels
    torch.testing.assert_close(hidden.grad, want_grads[0], rtol=1e-5, atol=1e-5)  # fp32 softmax vs fp64
    torch.testing.assert_close(weight.grad, want_grads[1], rtol=1e-5, atol=1e-5)


def test_gradient_flows_to_hidden_only_when_the_weight_is_frozen():
    torch.manual_seed(1)
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(30, 8)
    labels = torch.randint(0, 30, (5,))
    got, entropy = linear_log_probs(hidden, weight, labels, chunk_tokens=2)
    got.sum().backward()
    want, _ = reference(hidden, weight, labels)
    assert entropy is None
    torch.testing.assert_close(hidden.grad, torch.autograd.grad(want.sum(), hidden)[0], rtol=1e-5, atol=1e-6)


def test_bad_chunk_size_is_named():
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_log_probs(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), chunk_tokens=0)


def _tiny(model_type: str, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if model_type == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kwargs))
    return LlamaForCausalLM(LlamaConfig(**kwargs))


@pytest.mark.parametrize("model_type,tied", [("qwen2", False), ("qwen2", True), ("llama", True)])
def test_policy_log_probs_use_the_fused_head_and_equal_the_logits_path(model_type, tied):
    model = _tiny(model_type, tied)
    input_ids = torch.randint(0, 97, (3, 10))
    labels = torch.randint(0, 97, (3, 10))

    logits = model(input_ids, use_cache=False).logits
    assert logits.shape[-1] == 97  # the head is restored after a fused call (checked again below)
    want = token_log_probs(logits, labels)
    want_entropy = compute_entropy(logits.detach())
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    got = get_response_log_probs(model, input_ids, labels, return_token_entropy=True)
    got["log_probs"].sum().backward()
    torch.testing.assert_close(got["log_probs"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["token_entropy"], want_entropy, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert model(input_ids, use_cache=False).logits.shape == (3, 10, 97)
    assert "forward" not in vars(model.get_output_embeddings())


@pytest.mark.parametrize("one_graph", [False, True])
def test_compiled_decoder_layers_give_the_same_log_probs_and_gradients(one_graph):
    from a5core.policy.causal_lm import compile_decoder_layers

    eager, compiled = _tiny("qwen2", True), compile_decoder_layers(_tiny("qwen2", True), one_graph=one_graph)
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    for length in (10, 7):  # a second shape: recompiled, still equal
        input_ids = torch.randint(0, 97, (2, length))
        labels = torch.randint(0, 97, (2, length))
        for model in (eager, compiled):
            model.zero_grad()
            get_response_log_probs(model, input_ids, labels)["log_probs"].sum().backward()
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_compiling_twice_keeps_the_first_compilation():
    from a5core.policy.causal_lm import compile_decoder_layers

    model = compile_decoder_layers(_tiny("qwen2", True))
    first = [layer._compiled_call_impl for layer in model.model.layers]
    compile_decoder_layers(model)
    assert [layer._compiled_call_impl for layer in model.model.layers] == first
    assert all(f is not None for f in first)
