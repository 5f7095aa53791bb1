"""Run by tests/a5core/runtime/test_distributed.py under torchrun (gloo, CPU): one SFT-style step on this rank's share
of a fixed batch, FSDP2-sharded, and the full gradient saved by rank 0. ``python -m torch.distributed.run
--nproc-per-node N tests/distributed_target.py TOKENIZER_DIR OUT.pt MICROBATCH``"""

import sys

import torch
import torch.distributed as dist

from a5core.policy.causal_lm import get_response_log_probs, tokenize_prompt_and_output
from a5core.runtime.distributed import global_sum, global_token_loss, init_from_env, shard


def batch():
    """Eight prompt/response pairs of very different response lengths (so the split matters)."""
    return [(f"Q{i}: {i} + {i}?", " so" * (1 + 5 * (i % 3)) + f" {2 * i} </answer>") for i in range(8)]


def model_and_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config), tokenizer


def main(tokenizer_dir: str, out: str, microbatch: str) -> None:
    torch.set_num_threads(1)
    rank, world = init_from_env()
    model, tokenizer = model_and_tokenizer(tokenizer_dir)
    if world > 1:
        shard(model)
    pairs = batch()[rank::world]
    encoded = tokenize_prompt_and_output([p for p, _ in pairs], [r for _, r in pairs], tokenizer)
    tokens = global_sum(int(encoded["response_mask"].sum())).item()
    size = int(microbatch)
    for start in range(0, len(pairs), size):
        rows = slice(start, start + size)
        log_probs = get_response_log_probs(model, encoded["input_ids"][rows], encoded["labels"][rows])["log_probs"]
        global_token_loss(-log_probs, encoded["response_mask"][rows], tokens).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    if rank == 0:
        torch.save(grads, out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
