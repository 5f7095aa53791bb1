"""Policy training over several processes (GPUs) with FSDP2, normalised so results do not depend on them.

Launch with ``torchrun --nproc-per-node N ...``; each rank trains on its own share of a batch. The
handout's per-micro-batch means depend on how a batch is cut: a rank that holds short responses would
weigh each token more than one holding long responses. Here the loss of a batch is

    Σ_ranks Σ_sequences Σ_t w_t · ℓ_t  /  (number of response tokens in the whole batch, over all ranks)

so the gradient is the same for 1 or N ranks and any micro-batch size (:func:`global_token_loss`,
tested on CPU with the gloo backend). FSDP2 averages gradients over ranks (divides their sum by N), so
each rank's share is multiplied by N first (gloo cannot reduce with FSDP2's pre-multiplied sum).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…); returns
    ``(rank, world_size)``, ``(0, 1)`` when not launched by torchrun. NCCL on CUDA, gloo on CPU."""
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2-shard a transformers causal LM: each decoder layer, then the root (gradients are averaged
    over ranks, which :func:`global_token_loss` accounts for). Returns the same module, now sharded."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def global_sum(value: torch.Tensor | float | int) -> torch.Tensor:
    """Sum of ``value`` over all ranks (itself when not distributed), as a float64 tensor."""
    total = torch.as_tensor(value, dtype=torch.float64)
    if dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        total = total.to(device)
        dist.all_reduce(total)
    return total.cpu()


def global_token_loss(per_token_loss: torch.Tensor, response_mask: torch.Tensor, global_tokens: float) -> torch.Tensor:
    """This rank's (or micro-batch's) share of the batch loss, to back-propagate: Σ masked per-token
    loss × world size / ``global_tokens`` (× world size because FSDP2 averages gradients over ranks).

    per_token_loss, response_mask: (B, T); global_tokens: response tokens of the whole batch on all
    ranks (:func:`global_sum` of the local counts). The gradients of these shares, summed over
    micro-batches and averaged over ranks, are the gradient of the batch loss, whatever the split.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    masked = torch.where(response_mask.bool(), per_token_loss, torch.zeros((), dtype=per_token_loss.dtype,
                                                                            device=per_token_loss.device))
    return masked.sum() * world / global_tokens
