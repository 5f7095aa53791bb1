"""What a GRPO step measures: :class:`StepStats` (what its optimizer steps accumulate, read once each),
:class:`EngineMismatch` (how far the engine's sampling is from the policy) and :class:`PhaseTimer` (the
seconds of each phase).

Shapes: ``b`` rollouts of a micro-batch, ``T`` its token positions.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from a5core.loops.grpo.batch import MicroBatch
from a5core.runtime import distributed

# The engine mismatch's sums over response tokens (summed over micro-batches and ranks; see EngineMismatch).
_MISMATCH_SUMS = ("mismatch_log_ratio_sum", "mismatch_k3_sum", "mismatch_over_cap_tokens", "mismatch_tokens")
# What one optimizer step accumulates over its micro-batches (summed over ranks when read).
_STEP_SUMS = (
    "loss",
    "clipped",
    "ratio_sum",
    "entropy_sum",
    "kl_sum",
    "response_tokens",
    "entropy_tokens",
    "tokens",
    *_MISMATCH_SUMS,
)
MISMATCH_RATIO_CAP = 2.0  # the ratio π_train/π_engine whose share of tokens beyond it is logged when tis_cap is off


class PhaseTimer:
    """Seconds spent in each phase of a step (``time_<phase>``), the GPU synchronised at both ends. Each phase
    is announced to ``on_phase`` (if set) as it starts: the progress shown names it."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, {}
        self.on_phase: Callable[[str], None] | None = None

    def announce(self, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(phase)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.announce(phase)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        key = f"time_{phase}"
        self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start


class EngineMismatch:
    """How far the engine's sampling distribution is from the policy's, over response tokens the engine
    sampled: with d = log π_train − log π_engine at each token and r = exp(d) = π_train/π_engine,
    ``mismatch_log_ratio_mean`` and ``mismatch_log_ratio_max`` (of d), ``mismatch_kl_k3`` (the mean of
    k3 = r − 1 − log r, Schulman's estimator: the tokens being the engine's samples at temperature 1, an
    unbiased estimate of KL(π_engine ‖ π_train), never negative) and ``mismatch_over_cap`` (the share of
    tokens with r > ``tis_cap``, or :data:`MISMATCH_RATIO_CAP` when it is off: those whose importance weight
    the cap truncates). π_train is the trainer's log-prob at the weights the engine was last given, so one
    step off (``pipeline_depth`` 1) the step of lag counts too, as it does for the importance weight."""

    def __init__(self, tis_cap: float | None) -> None:
        self.cap = MISMATCH_RATIO_CAP if tis_cap is None else tis_cap

    def sums(
        self, train_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, mask: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """train_log_probs, engine_log_probs, mask: (b, T) (any shape, alike) → the ``_MISMATCH_SUMS`` over
        the masked tokens, and the largest d among them (−inf if none): float64 scalars on their device,
        no host sync."""
        d = torch.where(mask, train_log_probs.detach().double() - engine_log_probs.double(), 0.0)
        sums = {
            "mismatch_log_ratio_sum": d.sum(),
            "mismatch_k3_sum": (torch.expm1(d) - d).sum(),  # r − 1 − log r, exact to float64 for small d
            "mismatch_over_cap_tokens": (mask & (torch.exp(d) > self.cap)).sum().double(),
            "mismatch_tokens": mask.sum().double(),
        }
        return sums, torch.where(mask, d, -math.inf).max()

    @staticmethod
    def metrics(totals: Mapping[str, float]) -> dict[str, float]:
        """The metrics from the ``_MISMATCH_SUMS`` and the largest d (``mismatch_log_ratio_max``); none
        without tokens."""
        tokens = totals["mismatch_tokens"]
        if not tokens:
            return {}
        return {
            "mismatch_log_ratio_mean": totals["mismatch_log_ratio_sum"] / tokens,
            "mismatch_log_ratio_max": totals["mismatch_log_ratio_max"],
            "mismatch_kl_k3": totals["mismatch_k3_sum"] / tokens,
            "mismatch_over_cap": totals["mismatch_over_cap_tokens"] / tokens,
        }

    def of_rollouts(
        self, train_log_probs: list[torch.Tensor], engine_log_probs: list[torch.Tensor]
    ) -> dict[str, float]:
        """The metrics over whole rollouts: train_log_probs, engine_log_probs: N 1-D tensors each, the i-th of
        both rollout i's response log-probs."""
        train, engine = torch.cat(train_log_probs), torch.cat(engine_log_probs)
        sums, peak = self.sums(train, engine, torch.ones_like(train, dtype=torch.bool))
        return self.metrics({**{k: v.item() for k, v in sums.items()}, "mismatch_log_ratio_max": peak.item()})


class StepStats:
    """A step's training statistics. Within an optimizer step they stay on the device (no sync per
    micro-batch) until :meth:`read` sums them over ranks, once; over the step's optimizer steps they become
    its metrics: the objective's own (``loss_metrics``: clip_fraction, kl), the ratio π/π_old where old
    log-probs are computed (``ratios``), and the engine ``mismatch`` when it is measured here: from the first
    optimizer step's training forward, whose weights are still those the engine sampled with."""

    def __init__(
        self, device: torch.device, loss_metrics: Sequence[str], ratios: bool, mismatch: EngineMismatch | None = None
    ) -> None:
        self.device, self.ratios, self.mismatch = device, ratios, mismatch
        self.reports = (*loss_metrics, *(("ratio_mean",) if ratios else ()))
        self.sums = {"loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "kl": 0.0}
        self.ratio_max, self.entropy_sum, self.entropy_tokens, self.tokens = 0.0, 0.0, 0.0, 0.0
        self.optimizer_steps, self.passes = 0, 0
        self.mismatch_metrics: dict[str, float] = {}

    def begin(self, microbatches: int) -> None:
        """An optimizer step of ``microbatches`` passes begins (again, if its first attempt ran out of memory:
        what that attempt accumulated is dropped)."""
        self.acc = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in _STEP_SUMS}
        self.ratio_peak = torch.zeros((), dtype=torch.float64, device=self.device)
        self.mismatch_peak = torch.full((), -math.inf, dtype=torch.float64, device=self.device)
        self.microbatches = microbatches

    def add(
        self,
        n_tokens: int,
        mb: MicroBatch,
        out: dict[str, torch.Tensor],
        loss: torch.Tensor,
        meta: dict[str, torch.Tensor],
        world: int,
    ) -> None:
        """One micro-batch ``mb`` of ``n_tokens`` response tokens: the policy's ``out`` on it, its (scaled) loss
        and metadata."""
        acc, mask = self.acc, mb.response_mask
        acc["loss"] += loss / world
        acc["response_tokens"] += n_tokens
        acc["tokens"] += mb.input_ids.numel()
        if "clip_fraction" in meta:
            acc["clipped"] += meta["clip_fraction"].double() * n_tokens
        if "kl" in meta:
            acc["kl_sum"] += meta["kl"].double() * n_tokens
        if mb.old_log_probs is not None:
            ratio = torch.where(mask, torch.exp(out["log_probs"].detach() - mb.old_log_probs), 0.0)
            acc["ratio_sum"] += ratio.sum()
            self.ratio_peak = torch.maximum(self.ratio_peak, ratio.max())
        if "token_entropy" in out:
            acc["entropy_sum"] += torch.where(mask, out["token_entropy"], 0.0).sum()
            acc["entropy_tokens"] += n_tokens
        if self.mismatch is not None and not self.optimizer_steps:
            sums, peak = self.mismatch.sums(out["log_probs"], mb.engine_log_probs, mask)
            for key, value in sums.items():
                acc[key] += value
            self.mismatch_peak = torch.maximum(self.mismatch_peak, peak)

    def read(self, grad_norm: torch.Tensor) -> dict[str, float]:
        """The optimizer step's statistics, summed (the peaks: maximum) over ranks, and the gradient norm: the
        one read of the step."""
        values = torch.cat(
            [
                distributed.global_sum(torch.stack(list(self.acc.values()))),
                distributed.global_max(torch.stack([self.ratio_peak, self.mismatch_peak])),
                distributed.full_tensor(grad_norm).double().view(1),
            ]
        ).tolist()
        return dict(zip([*self.acc, "ratio_max", "mismatch_log_ratio_max", "grad_norm"], values, strict=True))

    def stepped(self, got: dict[str, float]) -> None:
        """The optimizer stepped with statistics ``got`` (from :meth:`read`)."""
        if self.mismatch is not None and not self.optimizer_steps:
            self.mismatch_metrics = self.mismatch.metrics(got)
        self.optimizer_steps += 1
        self.passes += self.microbatches
        tokens = max(got["response_tokens"], 1)
        self.sums["loss"] += got["loss"]
        self.sums["grad_norm"] += got["grad_norm"]
        self.sums["clip_fraction"] += got["clipped"] / tokens
        self.sums["ratio_mean"] += got["ratio_sum"] / tokens
        self.sums["kl"] += got["kl_sum"] / tokens
        self.ratio_max = max(self.ratio_max, got["ratio_max"])
        self.entropy_sum += got["entropy_sum"]
        self.entropy_tokens += got["entropy_tokens"]
        self.tokens += got["tokens"]

    def metrics(self, **extra: float) -> dict[str, float]:
        """Means over the optimizer steps (the ratio's peak: maximum), entropy per token, counts, the engine
        mismatch where measured here, and ``extra``; only ``optimizer_steps`` 0 when the step trained on nothing
        (every group dropped)."""
        if not self.optimizer_steps:
            return {"optimizer_steps": 0.0}
        metrics = {k: v / self.optimizer_steps for k, v in self.sums.items()}
        for key in ("clip_fraction", "kl", "ratio_mean"):
            if key not in self.reports:
                del metrics[key]
        if self.ratios:
            metrics["ratio_max"] = self.ratio_max
        metrics.update(
            {
                "token_entropy": self.entropy_sum / max(self.entropy_tokens, 1),
                "optimizer_steps": float(self.optimizer_steps),
                "train_tokens": self.tokens,
                "microbatches": float(self.passes),
                **self.mismatch_metrics,
                **extra,
            }
        )
        return metrics
