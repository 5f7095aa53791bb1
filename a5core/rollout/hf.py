"""transformers rollout backend: batched ``model.generate`` with left padding; vLLM's semantics.

For machines without vLLM (CPU boxes, CI) and as a reference to check the vLLM backend against.
See ``a5core.rollout`` for the shared semantics; how this backend gets there:

- Prompts are repeated ``n`` times (greedy: generated once, then copied) and generated in chunks of
  ``batch_size`` sequences, each chunk left-padded.
- Sampling uses a fresh generation config (the model's own ``generation_config`` sampling defaults,
  such as top-k 50 or a repetition penalty, are not applied): temperature, top-p, ``min_new_tokens``.
- Stop strings: a stopping criterion ends a sequence when a stop string completes in its newest
  token (after ``min_tokens`` tokens); the same rule is then applied to each finished sequence's
  text to cut ``text`` and ``token_ids``. Each step the criterion decodes only the rows whose newest
  token can complete a stop string: a token does so only if its own text holds a stop string's last
  character, or a U+FFFD (a byte fragment, which may complete a multi-byte character). The engine
  builds that vocabulary table once per set of stop strings (one batch decode of the vocabulary); if
  a stop string ends in whitespace, which a decoder may drop from a lone token, every row is decoded.
- ``seed``: the whole call runs under ``torch.manual_seed(seed)`` in a forked RNG (the global RNG is
  left as it was); without a seed the global RNG is used.
- Log-probs: after generation, one teacher-forced forward pass over prompt + completion gives
  log-softmax(logits)[token] in fp32 for each generated token (raw distribution, temperature 1,
  before top-p), the quantity ``a5core.policy.get_response_log_probs`` computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from a5core import progress
from a5core.policy import LOGPROB_CHUNK_TOKENS, load_policy, pad_id_of, token_log_probs
from a5core.rollout import Completion, SamplingSettings, check_prompts, resolve_dtype

_STRIP_PREFIXES = ("module.", "_orig_mod.")  # DDP / torch.compile wrappers around a policy


def _stop_end(text: str, stops: Sequence[str], start: int) -> int | None:
    """End offset of the stop string that completes earliest among those ending after ``start``."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0 and (best is None or at + len(stop) < best):
            best = at + len(stop)
    return best


class _StopOnStrings:
    """StoppingCriteria: true for rows whose newest token completes a stop string (past min_tokens).

    Decodes only a window of recent tokens, wide enough for the longest stop string, and only in the
    rows whose newest token is flagged in ``candidates`` (a bool tensor over token ids on the ids'
    device; ids past its end count as flagged); ``candidates`` None: every row.
    """

    def __init__(self, decode, stops: Sequence[str], prompt_len: int, min_tokens: int, candidates: torch.Tensor | None = None):
        self.decode, self.stops, self.prompt_len, self.min_tokens = decode, tuple(stops), prompt_len, min_tokens
        self.candidates = candidates
        # tokens to decode: each decodes to >= 1 character, except byte fragments of a multi-byte one
        self.window = 4 * max(len(s) for s in stops) + 8

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids.shape[1] - self.prompt_len
        if generated <= self.min_tokens:
            return done
        window = input_ids[:, max(self.prompt_len, input_ids.shape[1] - self.window) :]
        if self.candidates is None:
            rows = list(range(input_ids.shape[0]))
        else:
            newest = input_ids[:, -1]
            size = self.candidates.shape[0]
            flagged = self.candidates[newest.clamp(max=size - 1)] | (newest >= size)
            rows = flagged.nonzero().flatten().tolist()  # the one device sync of a step
            if not rows:
                return done
            window = window[rows]
        hits = []
        for row, tail in zip(rows, window.tolist()):
            before = len(self.decode(tail[:-1]))
            if _stop_end(self.decode(tail), self.stops, before) is not None:
                hits.append(row)
        if hits:
            done[hits] = True
        return done


def stop_candidates(token_texts: Sequence[str], stops: Sequence[str]) -> list[bool] | None:
    """Per token id (``token_texts[i]``: token i decoded alone): can it complete one of ``stops``?

    True when the text holds a stop string's last character or U+FFFD (a byte fragment). None (no
    filtering) when a stop string ends in whitespace: a decoder may strip it from a lone token.
    """
    lasts = {stop[-1] for stop in stops}
    if any(c.isspace() for c in lasts):
        return None
    marks = lasts | {"\ufffd"}
    return [any(c in text for c in marks) for text in token_texts]


class HFEngine:
    """Rollouts with ``transformers`` ``generate``; see ``a5core.rollout`` for the shared semantics.

    ``model``: a causal LM (its own copy: ``load_weights`` writes into it); ``tokenizer``: its
    tokenizer; ``batch_size``: sequences per ``generate`` call (prompts × n are chunked).
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 64):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = pad_id_of(tokenizer)
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = sorted(set(eos))
        self._token_texts: list[str] | None = None  # each token id decoded alone, built on first need
        self._candidates: dict[tuple[str, ...], torch.Tensor | None] = {}

    @classmethod
    def from_pretrained(
        cls, model: str, *, dtype: str | torch.dtype = "auto", device: str | None = None, batch_size: int = 64
    ) -> HFEngine:
        """Load model and tokenizer from a local directory or hub id (no remote code)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = resolve_dtype(dtype, torch.device(device).type)
        policy, tokenizer = load_policy(model, dtype=torch_dtype, device=device)
        return cls(policy, tokenizer, batch_size=batch_size)

    # ------------------------------------------------------------------------------- generation

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _stop_candidates(self, stops: tuple[str, ...]) -> torch.Tensor | None:
        """Bool tensor over token ids (model's device): may the token complete one of ``stops``?"""
        if stops not in self._candidates:
            if self._token_texts is None:
                ids = [[i] for i in range(len(self.tokenizer))]
                self._token_texts = self.tokenizer.batch_decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
                )
            flags = stop_candidates(self._token_texts, stops)
            self._candidates[stops] = None if flags is None else torch.tensor(flags, dtype=torch.bool, device=self.model.device)
        return self._candidates[stops]

    def generate(self, prompts: Sequence[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """``len(prompts)`` lists of ``sampling.n`` Completions, prompt order kept."""
        prompts = check_prompts(prompts)
        copies = 1 if sampling.greedy else sampling.n
        expanded = [p for p in prompts for _ in range(copies)]
        device = self.model.device
        if sampling.seed is None:
            rng = contextlib.nullcontext()
        else:
            rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        completions: list[Completion] = []
        with rng, torch.no_grad(), progress.bar(desc="generate", total=len(expanded), unit="seq") as sequences:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            for start in range(0, len(expanded), self.batch_size):
                completions += self._generate_batch(expanded[start : start + self.batch_size], sampling)
                sequences.update(len(completions) - sequences.n)
        groups = [completions[i * copies : (i + 1) * copies] for i in range(len(prompts))]
        return [group * sampling.n for group in groups] if sampling.greedy else groups

    def _generate_batch(self, prompts: list[str], s: SamplingSettings) -> list[Completion]:
        from transformers import GenerationConfig, StoppingCriteriaList

        device = self.model.device
        enc = self.tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        input_ids, attention_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        prompt_len = input_ids.shape[1]
        config = GenerationConfig(
            max_new_tokens=s.max_tokens,
            min_new_tokens=s.min_tokens or None,
            do_sample=not s.greedy,
            temperature=s.temperature if not s.greedy else None,
            top_p=s.top_p if not s.greedy else None,
            top_k=0 if not s.greedy else None,  # 0: no top-k (transformers' global default is 50)
            eos_token_id=self.eos_ids or None,
            pad_token_id=self.pad_id,
        )
        criteria = StoppingCriteriaList()
        if s.stop:
            criteria.append(_StopOnStrings(self._decode, s.stop, prompt_len, s.min_tokens, self._stop_candidates(tuple(s.stop))))
        # Swap in a neutral generation config so the model's sampling defaults are not merged in.
        saved, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config, stopping_criteria=criteria
            )
        finally:
            self.model.generation_config = saved
        rows = [self._finish(ids, s) for ids in out[:, prompt_len:].tolist()]
        if s.logprobs:
            log_probs = self._log_probs(input_ids, attention_mask, [ids for _, ids, _ in rows])
            return [Completion(text, tuple(ids), why, tuple(lp)) for (text, ids, why), lp in zip(rows, log_probs)]
        return [Completion(text, tuple(ids), why) for text, ids, why in rows]

    def _finish(self, ids: list[int], s: SamplingSettings) -> tuple[str, list[int], str]:
        """(text, token_ids, finish_reason) of one generated row (which may carry trailing padding)."""
        finish = "length"
        for i, token in enumerate(ids):
            if token in self.eos_ids:
                ids, finish = ids[: i + 1], "stop"
                break
        text = self._decode(ids)
        if s.stop:
            boundary = len(self._decode(ids[: s.min_tokens])) if s.min_tokens else 0
            end = _stop_end(text, s.stop, boundary)
            if end is not None:
                # the fewest tokens whose text reaches the end of the stop string
                lo, hi = max(s.min_tokens, 1), len(ids)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if len(self._decode(ids[:mid])) >= end:
                        hi = mid
                    else:
                        lo = mid + 1
                return text[:end], ids[:lo], "stop"
        if finish == "length" and len(ids) < s.max_tokens:  # the stopping criterion and this cut disagree
            raise RuntimeError(f"bug: generation ended after {len(ids)} of {s.max_tokens} tokens without EOS or stop string")
        return text, ids, finish

    def _log_probs(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completions: list[list[int]]
    ) -> list[list[float]]:
        """Teacher-forced fp32 log-probs of each completion's tokens given its (left-padded) prompt."""
        device = prompt_ids.device
        width = max(len(ids) for ids in completions)
        response = torch.full((len(completions), width), self.pad_id, dtype=torch.long, device=device)
        response_mask = torch.zeros_like(response)
        for row, ids in enumerate(completions):
            response[row, : len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
            response_mask[row, : len(ids)] = 1
        input_ids = torch.cat([prompt_ids, response], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # The logits at position t predict token t+1: the last width+1 positions, less the very last,
        # predict the response tokens. A few rows at a time, so that at most ~LOGPROB_CHUNK_TOKENS
        # positions of (V,) logits exist at once.
        rows_per_chunk = max(1, LOGPROB_CHUNK_TOKENS // width)
        pieces = []
        for r in range(0, len(completions), rows_per_chunk):
            rows = slice(r, r + rows_per_chunk)
            logits = self.model(
                input_ids=input_ids[rows], attention_mask=attention_mask[rows], position_ids=position_ids[rows],
                logits_to_keep=width + 1,
            ).logits[:, :-1]
            pieces.append(token_log_probs(logits, response[rows]))
        values = torch.cat(pieces)
        return [values[row, : len(ids)].tolist() for row, ids in enumerate(completions)]

    # --------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def load_weights(self, policy_model: torch.nn.Module) -> None:
        """Copy ``policy_model``'s parameters and buffers into the engine's model (any device/dtype).

        A no-op when the policy *is* the engine's model. Names must match (DDP ``module.`` and
        ``torch.compile`` ``_orig_mod.`` prefixes are stripped).
        """
        if policy_model is self.model:
            return
        state = {}
        for name, tensor in policy_model.state_dict().items():
            for prefix in _STRIP_PREFIXES:
                while name.startswith(prefix):
                    name = name[len(prefix) :]
            state[name] = tensor
        self.model.load_state_dict(state, strict=True)
