"""LoRA adapters on the policy, through ``peft``: the loops train low-rank updates of chosen linear layers
instead of every weight.

``lora_rank`` > 0 makes :func:`add_adapters` inject into the model, in place, one adapter per target
module (``peft.inject_adapter_in_model``: the module keeps its name, the frozen weight moves to
``<name>.base_layer``, the trainable matrices are ``<name>.lora_A.default`` (r × in) and
``<name>.lora_B.default`` (out × r, zero at first, so training starts from the model itself)); every other
parameter is frozen. The layer computes W x + (α / r) · B A x.

What leaves the trainer is the merged model, W + (α / r) · B A under the model's own names
(:func:`merged_state_dict`): the engines get it on every weight push (:class:`MergedPolicy`, what
:func:`a5core.engines.full_weights` returns for an adapted model) and a saved model folder holds it, so
anything that loads a Hugging Face folder loads the trained model. Checkpoints hold the state dict as it is,
adapters included, and resume exactly. One process only (several ranks: refused; FSDP2 and adapters
together are not built yet).

Shapes: a target linear layer W (out, in); A (r, in); B (out, r).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from a5core.runtime.settings import Settings

# Every linear layer of a Llama-family decoder block (attention and MLP).
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRASettings(Settings):
    """LoRA: a rank, a scale, the modules adapted (see :mod:`a5core.policy.lora`)."""

    lora_rank: int = Field(0, ge=0, description="LoRA rank r (0: full fine-tuning)")
    lora_alpha: float = Field(32.0, gt=0, allow_inf_nan=False, description="LoRA scale α (the update is α / r · BA)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    lora_target_modules: list[str] = Field(
        list(ALL_LINEAR), min_length=1, description="names of the linear layers that get adapters"
    )


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (peft's layers hold ``lora_A``). Asked on every weight push:
    it does not import peft, so a run without adapters never loads it."""
    return any(hasattr(module, "lora_A") for module in model.modules())


def add_adapters(model: torch.nn.Module, settings: LoRASettings) -> None:
    """Inject adapters into ``model`` in place (nothing when ``lora_rank`` is 0 or the model has them
    already: an EI round trains the adapters of the last) and freeze every other parameter. ValueError
    under several ranks, or when no module has a target name."""
    if not settings.lora_rank or has_adapters(model):
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("lora_rank > 0 on several ranks (torchrun): LoRA runs in one process only")
    from peft import LoraConfig, inject_adapter_in_model

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    if not names & set(settings.lora_target_modules):
        raise ValueError(
            f"lora_target_modules {settings.lora_target_modules}: no linear layer of the model has those names "
            f"(it has {', '.join(sorted(names))})"
        )
    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.lora_target_modules),
    )
    inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the model the adapters make, under the base model's names: each adapted
    layer's weight W + (α / r) · B A (in W's dtype), the adapters' own tensors left out."""
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # tied tensors stay one object
        if ".lora_" not in name:
            merged[name.replace(".base_layer.", ".")] = tensor.detach()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer().weight
            delta = sum(
                (module.lora_B[a].weight.float() @ module.lora_A[a].weight.float()) * module.scaling[a]
                for a in module.active_adapters
            )
            merged[f"{name}.weight"] = (base.float() + delta).to(base.dtype)
    return merged


class MergedPolicy:
    """What an engine's ``load_weights`` takes for an adapted policy: ``state_dict()`` is the merged one.
    ``policy``: the adapted model itself (an engine that decodes with it needs no push)."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def state_dict(self, **_: Any) -> dict[str, Any]:
        return merged_state_dict(self.policy)
