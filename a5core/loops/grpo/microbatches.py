"""A GRPO step's micro-batches on this rank: by count or by token budget, as tensors, with the stand-ins FSDP2
needs and the out-of-memory error that names the micro-batch (:class:`MicroBatches`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from a5core.loops.grpo.batch import MicroBatch, RolloutBatch
from a5core.policy.causal_lm import pad_id_of
from a5core.runtime import distributed
from a5core.runtime.out_of_memory import naming_the_microbatch
from a5core.runtime.token_budget import TokenBudget


class MicroBatches:
    """This rank's micro-batches of a train batch (:func:`a5core.runtime.distributed.rank_microbatches`): of ``size``
    rollouts, or by the token ``budget`` (:class:`a5core.runtime.token_budget.TokenBudget`; then padded to a multiple of
    64 positions, so compiled layers see few shapes). Counts the shapes seen, for the metrics and an
    out-of-memory error, whose advice is ``advice`` (the setting to change)."""

    def __init__(self, size: int, budget: TokenBudget, advice: str, tokenizer: Any, device: torch.device) -> None:
        self.size, self.budget, self.advice = size, budget, advice
        self.pad_id, self.device = pad_id_of(tokenizer), device
        self.shapes: set[tuple[int, ...]] = set()  # the (rows, positions) of every micro-batch so far
        self.last_shape: tuple[int, ...] | None = None

    def split(self, batch: RolloutBatch, items: Sequence[int]) -> list[list[int]]:
        budget = self.budget.value
        lengths = batch.lengths if budget is not None else None
        return distributed.rank_microbatches(items, self.size, lengths, budget)

    def tensors(self, batch: RolloutBatch, index: list[int], stand_in: list[int]) -> MicroBatch:
        """The micro-batch ``index`` as tensors (:meth:`RolloutBatch.tensors`). An empty share (this rank has
        no rollout left) still runs a pass, FSDP2's collectives need it: rollouts ``stand_in`` at advantage 0."""
        multiple = distributed.PAD_MULTIPLE if self.budget.value is not None else 1
        mb = batch.select(index or stand_in).tensors(self.pad_id, self.device, multiple)
        if not index:
            mb = mb._replace(advantages=torch.zeros_like(mb.advantages), raw_rewards=torch.zeros_like(mb.raw_rewards))
        self.last_shape = tuple(mb.input_ids.shape)
        self.shapes.add(self.last_shape)
        return mb

    def naming(self, where: str) -> contextlib.AbstractContextManager[None]:
        """Out of GPU memory inside: one error naming ``where``, the last micro-batch's shape and the setting."""
        return naming_the_microbatch(where, lambda: self.budget.value, self.advice, lambda: self.last_shape)
