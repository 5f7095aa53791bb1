"""LoRA (a5core.policy.lora, through peft): one SFT step by hand, the merged model in an engine and in a saved
folder, the loops with adapters, resume."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_loops import make_model, params_of, short_examples

from a5core.loops.sft import SFTConfig, train_sft
from a5core.policy.causal_lm import get_response_log_probs, tokenize_prompt_and_output
from a5core.policy.lora import LoRASettings, add_adapters, has_adapters, merged_state_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGETS = ["q_proj", "v_proj"]


def lora_config(**overrides) -> SFTConfig:
    settings = dict(
        learning_rate=1e-2, batch_size=4, microbatch_size=2, epochs=1, max_steps=1, grad_clip=0.0,
        lora_rank=4, lora_alpha=8.0, lora_target_modules=TARGETS,
    )  # fmt: skip
    return SFTConfig(**{**settings, **overrides})


def test_one_sft_step_trains_only_the_adapters_as_computed_by_hand(tokenizer):
    """W x + (α/r)·B A x with B = 0 at first: the step's gradient reaches B only (A's is 0 while B is 0);
    the loss and B's update written out here with the base model, one AdamW step."""
    model = make_model(tokenizer)
    base = copy.deepcopy(model)
    examples = short_examples(4)
    config = lora_config()
    train_sft(model, tokenizer, examples, config)
    assert has_adapters(model)
    trained = dict(model.named_parameters())
    assert all(("lora_" in n) == p.requires_grad for n, p in trained.items())

    # By hand: the same adapters' A (as peft initialised them: read from the model, they did not move),
    # B = 0 as a leaf; the base model's layers call x ↦ W x + s·B A x.
    scale = config.lora_alpha / config.lora_rank
    hooks, leaves = [], {}
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            a = trained[f"{name}.lora_A.default.weight"].detach()
            b = torch.zeros(module.out_features, config.lora_rank, requires_grad=True)
            leaves[f"{name}.lora_B.default.weight"] = b
            hooks.append(module.register_forward_hook(lambda m, i, out, a=a, b=b: out + scale * i[0] @ a.T @ b.T))
    encoded = tokenize_prompt_and_output([e.prompt for e in examples], [e.response for e in examples], tokenizer)
    log_probs = get_response_log_probs(base, encoded["input_ids"], encoded["labels"])["log_probs"]
    mask = encoded["response_mask"]
    loss = -((log_probs * mask).sum(dim=1)).mean()  # normalize_constant 1: summed log-prob per sequence
    loss.backward()
    for hook in hooks:
        hook.remove()
    for name, b in leaves.items():
        g = b.grad
        expected = -config.learning_rate * g / (g.abs() + 1e-8)  # Adam's first step: lr · g / (|g| + eps)
        torch.testing.assert_close(trained[name].detach(), expected, atol=1e-6, rtol=1e-5, msg=name)
        assert g.abs().sum() > 0
    for name, parameter in base.named_parameters():  # the base weights did not move
        for target in TARGETS:
            name = name.replace(f".{target}.", f".{target}.base_layer.")
        torch.testing.assert_close(trained[name].detach(), parameter.detach(), atol=0, rtol=0, msg=name)


def test_the_merged_model_in_an_engine_and_a_saved_folder_gives_the_policys_log_probs(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from tasks.runs import save_model_folder

    model = make_model(tokenizer)
    train_sft(model, tokenizer, short_examples(8), lora_config(max_steps=2, batch_size=4))  # B ≠ 0 now
    merged = merged_state_dict(model)
    assert not any("lora_" in k or "base_layer" in k for k in merged) and set(merged) == set(
        make_model(tokenizer).state_dict()
    )
    engine = HFEngine(make_model(tokenizer, seed=5), tokenizer, batch_size=4)
    from a5core.engines import full_weights

    engine.load_weights(full_weights(model))
    prompts = ["What is 2 + 3?", "What is 7 + 1?"]
    completions = engine.generate(prompts, SamplingSettings(temperature=1.0, max_tokens=6, seed=0, logprobs=True))
    for prompt, group in zip(prompts, completions, strict=True):
        c = group[0]
        encoded = tokenize_prompt_and_output([prompt], [tokenizer.decode(c.token_ids)], tokenizer)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + list(c.token_ids)
        with torch.no_grad():
            policy = get_response_log_probs(model, torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]))["log_probs"]
        torch.testing.assert_close(policy[0, -len(c.token_ids) :], torch.tensor(c.log_probs), atol=1e-4, rtol=0)
        del encoded
    save_model_folder(model, tokenizer, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([tokenizer("What is 4 + 4? It is 8", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_sft_with_adapters_resumes_exactly(tokenizer, tmp_path):
    from tiny_loops import Recorder

    examples = short_examples(8)
    config = lora_config(max_steps=None, epochs=2, checkpoint_every=1, batch_size=4)
    reference = make_model(tokenizer)
    train_sft(reference, tokenizer, examples, config)
    crashed = make_model(tokenizer)
    with pytest.raises(KeyboardInterrupt):
        train_sft(crashed, tokenizer, examples, config, checkpoint_dir=tmp_path, log=Recorder(crash_at=3))
    resumed = make_model(tokenizer, seed=1)
    train_sft(resumed, tokenizer, examples, config, checkpoint_dir=tmp_path)
    for (name, a), b in zip(params_of(reference).items(), params_of(resumed).values(), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)


def test_grpo_and_ei_train_adapters_and_push_the_merged_model(tokenizer):
    from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, parity_reward, small_config

    from a5core.loops.expert_iteration import EIConfig, expert_iteration
    from a5core.loops.grpo import grpo

    class PushRecorder(RecordingEngine):
        pushed: list = []

        def load_weights(self, policy):
            self.pushed.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
            super().load_weights(policy)

    model = make_model(tokenizer)
    start = params_of(model)
    engine = PushRecorder(model, tokenizer)
    options = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=TARGETS)
    grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(n_grpo_steps=2, **options))
    assert has_adapters(model) and len(engine.pushed) == 2  # one push a step
    first, second = engine.pushed
    assert set(first) == set(start)  # the base model's names: the merged model, not the adapters
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(first[q], start[q])  # B = 0: the merged model is the start
    assert not torch.equal(second[q], start[q])  # step 1 trained B: the engine gets W + s·BA
    k = "model.layers.0.self_attn.k_proj.weight"
    torch.testing.assert_close(second[k], start[k])  # not adapted: unchanged
    ei_model = make_model(tokenizer)
    ei_engine = RecordingEngine(ei_model, tokenizer)
    config = EIConfig(
        n_ei_steps=2, questions_per_step=4, rollouts_per_question=2, batch_size=2, microbatch_size=2,
        max_tokens=8, min_tokens=1, entropy_sample=0, **options,
    )  # fmt: skip
    always = lambda response, truth: {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}  # noqa: E731
    expert_iteration(ei_model, tokenizer, ei_engine, PROBLEMS, TEMPLATE, always, config)
    assert sum("lora_" in n for n, _ in ei_model.named_parameters()) == 2 * len(TARGETS)  # one set, both rounds


def test_bad_targets_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="lora_target_modules \\['q_proj'\\]: no linear layer"):
        add_adapters(model, LoRASettings(lora_rank=2, lora_target_modules=["q_proj"]))


def test_sft_with_adapters_resumes_after_kill_9(tiny_lm_dir, tmp_path):
    """SIGKILL a LoRA SFT run in step 3 (checkpoint 2 written); the resumed run ends with the weights and
    adapters of the run never interrupted."""
    from kill9 import kill_when_frozen
    from sft_kill_target import CHECKPOINT_EVERY, LORA, build_run

    model, tokenizer, examples, kwargs = build_run(tiny_lm_dir)
    train_sft(model, tokenizer, examples, SFTConfig(**kwargs, **LORA))
    uninterrupted = params_of(model)

    checkpoint_dir, marker = tmp_path / "ckpt", tmp_path / "frozen"
    kill_when_frozen(
        "sft_kill_target.py", str(tiny_lm_dir), str(checkpoint_dir), str(marker), "lora_between_steps", marker=marker
    )
    model, tokenizer, examples, kwargs = build_run(tiny_lm_dir)
    train_sft(
        model, tokenizer, examples, SFTConfig(**kwargs, **LORA, checkpoint_every=CHECKPOINT_EVERY),
        checkpoint_dir=checkpoint_dir,
    )  # fmt: skip
    resumed = params_of(model)
    assert set(resumed) == set(uninterrupted) and any("lora_" in k for k in resumed)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, atol=0, rtol=0, msg=name)
