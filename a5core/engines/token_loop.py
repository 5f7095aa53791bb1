"""One token of the hf engine's static loop as one call on the device: decode, draw, record.

:class:`a5core.engines.hf.HFEngine`'s static loop generates a token a step for each running row: decode the row's
newest token over the KV cache (:class:`a5core.engines.static_decode.StaticKVDecoder`), draw the next one from its
logits (greedy, temperature by Gumbel-max, or top-p; EOS masked during the first ``min_tokens`` tokens), pad rows
already finished, record the token (and its log-prob, from the very logits it was drawn from), mark rows that drew
EOS and flag rows whose token may complete a stop string, and move on a cache column. :meth:`TokenLoop.step` does
all of that in one function over state kept on the device in buffers of fixed address (the rows' tokens, log-probs,
prompt masks, positions, finished and flagged rows, the token count); compiled with the decoder
(``torch.compile(mode="reduce-overhead")``), a token costs one CUDA graph replay and a few Python calls, with
nothing copied between host and device: the attention mask is made in the graph from the prompt's mask and the
count, the count is a device tensor the graph advances. The host reads that state back only every few tokens
(:meth:`TokenLoop.read_back`, one copy), to find rows ended by a stop string and to drop finished rows
(:meth:`TokenLoop.compact`).

The values of the sampling settings (temperature, top-p, min_tokens, the EOS ids, the stop strings' candidate
tokens) are device tensors the step reads, so a new value is no new compilation; only top-p changes the step's code
(one compilation more; greedy and temperature sampling share one: compiled, a greedy draw computes the Gumbel noise
and ignores it). Every step records the token's log-prob and
stop flag whether the generation asked for them or not (within the step's one pass over the logits: nearly free),
so that the rollouts (log-probs) and an evaluation (none) at one temperature share one compiled step. Uncompiled,
the step does only what the generation needs (no log-probs unless asked, no EOS mask after min_tokens), as the loop
before it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from a5core.engines.engine import SamplingSettings
from a5core.engines.static_decode import StaticKVDecoder


@dataclass
class Draw:
    """How the loop draws a token: ``greedy``, ``nucleus`` (top-p < 1) and ``hold_eos`` (``min_tokens``, an int)
    decide the code uncompiled; compiled, only ``nucleus`` does, and the step reads the values, tensors on the
    logits' device: ``sampling`` (bool, 0-d: not greedy), ``temperature`` and ``top_p`` (fp32, 0-d), ``min_tokens``
    (long, 0-d) and ``eos`` (V,) bool, the EOS ids, masked while fewer than ``min_tokens`` tokens exist."""

    greedy: bool
    nucleus: bool
    hold_eos: int
    sampling: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_tokens: torch.Tensor
    eos: torch.Tensor

    @classmethod
    def of(cls, s: SamplingSettings, eos: torch.Tensor) -> Draw:
        """``s``'s draw with ``eos`` (V,) bool: the EOS ids among the V logits."""
        draw = cls(
            False,
            False,
            0,
            torch.ones((), dtype=torch.bool, device=eos.device),
            torch.ones((), dtype=torch.float32, device=eos.device),
            torch.ones((), dtype=torch.float32, device=eos.device),
            torch.zeros((), dtype=torch.long, device=eos.device),
            eos.clone(),
        )
        draw.set(s, eos)
        return draw

    def set(self, s: SamplingSettings, eos: torch.Tensor) -> None:
        """Take ``s``'s settings, in place (the tensors keep their addresses)."""
        self.greedy, self.nucleus, self.hold_eos = s.greedy, not s.greedy and s.top_p < 1.0, s.min_tokens
        self.sampling.fill_(not s.greedy)
        self.temperature.fill_(1.0 if s.greedy else s.temperature)
        self.top_p.fill_(s.top_p)
        self.min_tokens.fill_(s.min_tokens)
        self.eos.copy_(eos)


def eos_table(eos_ids: list[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """(vocab,) bool: which of the logits' ids are EOS (ids past the logits are never drawn)."""
    table = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = [i for i in eos_ids if 0 <= i < vocab]
    if ids:
        table[torch.tensor(ids, device=device)] = True
    return table


def candidate_table(candidates: torch.Tensor | None, vocab: int, device: torch.device | str) -> torch.Tensor:
    """(vocab,) bool: may the token complete a stop string? ``candidates``: the engine's table over the tokenizer's
    ids (ids past its end count as flagged), or None: every token."""
    table = torch.ones(vocab, dtype=torch.bool, device=device)
    if candidates is not None:
        n = min(vocab, candidates.shape[0])
        table[:n] = candidates[:n]
    return table


class TokenLoop:
    """The static loop's state on the device for ``decoder``'s ``batch_size`` rows, and one token's work in one call.

    ``owner`` draws the tokens: ``owner._sample(logits, draw, count)`` → (b,) (:meth:`HFEngine._sample`: looked up
    at each call, so that a wrapper set on the engine is used; ``count``: the token's number, a (1,) device tensor
    in the compiled step, the host's int uncompiled), and ``owner.pad_id`` pads finished rows. Compiled
    when ``decoder`` is (its rows and width symbolic when it is ``varying``), its buffers at fixed addresses: keep
    one loop per decoder. Not thread-safe; one generation at a time.

    A generation: :meth:`begin` (the prompts' masks and the settings), the decoder's prefill, :meth:`first` (token 0
    from the prefill's logits), then :meth:`step` for each further token, :meth:`read_back` (and :meth:`finish_rows`,
    :meth:`compact`) every few tokens, :meth:`results` at the end. Rows: ``generated`` and ``sampled`` are by the
    chunk's row (0 … batch_size − 1), every other buffer by cache row; ``live`` maps cache rows to chunk rows.
    """

    def __init__(self, decoder: StaticKVDecoder, owner: Any):
        self.decoder, self.owner = decoder, owner
        rows, columns = decoder.batch_size, decoder.capacity + 1  # the cache's columns (one never attended)
        device = decoder.keys[0].device
        vocab = decoder.model.lm_head.weight.shape[0]
        self.rows = torch.arange(rows, device=device)
        self.columns = torch.arange(columns, device=device)
        self.generated = torch.zeros((rows, columns), dtype=torch.long, device=device)  # token t at column t
        self.sampled = torch.zeros((rows, columns), dtype=torch.float32, device=device)  # its log-prob
        self.valid = torch.zeros((rows, columns), dtype=torch.bool, device=device)  # the prompt columns attended
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # rotary position of token 0
        self.live = torch.zeros(rows, dtype=torch.long, device=device)  # the chunk row each cache row decodes
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.flagged = torch.zeros(rows, dtype=torch.bool, device=device)  # may have completed a stop string
        # tokens recorded; the cache column a step writes, start + count - 1, is computed from it on the device: a
        # Python int would be copied host-to-device at every step, which waits for the GPU to finish the step before
        # (benchmarks/RESULTS.md, "the cache column kept on the device")
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # the prompt's columns: token t at start + t
        self.candidates = torch.ones(vocab, dtype=torch.bool, device=device)
        self.draw = Draw.of(SamplingSettings(), torch.zeros(vocab, dtype=torch.bool, device=device))
        self.logprobs = False  # whether the generation asked for them (the compiled step records them either way)
        self.recorded = 0  # tokens recorded, as the host counts them (the uncompiled step reads it: no read-back)
        self.vocab = vocab
        if decoder.compiled:
            for buffer in self._buffers():
                torch._dynamo.mark_static_address(buffer)
            dynamic = None if decoder.varying else False
            self._step = torch.compile(self._token, mode="reduce-overhead", dynamic=dynamic)
        else:
            self._step = self._token

    def _buffers(self) -> list[torch.Tensor]:
        draw = self.draw
        return [
            self.generated,
            self.sampled,
            self.valid,
            self.positions,
            self.live,
            self.finished,
            self.flagged,
            self.count,
            self.start,
            self.candidates,
            draw.sampling,
            draw.temperature,
            draw.top_p,
            draw.min_tokens,
            draw.eos,
        ]

    # ------------------------------------------------------------------------------- the host's calls

    @torch.no_grad()
    def begin(
        self, valid: torch.Tensor, real: int, s: SamplingSettings, eos: torch.Tensor, candidates: torch.Tensor | None
    ) -> None:
        """A new generation: ``valid`` (rows, P) bool, the left-padded prompts' mask (all the decoder's rows; rows
        from ``real`` on are padding, finished from the start); ``eos`` (V,) bool: the EOS ids; ``candidates`` (V,)
        bool: the tokens that may complete one of ``s.stop`` (:func:`candidate_table`; None: no stop strings).
        Device work only, once a generation."""
        rows, prompt = valid.shape
        if rows != self.decoder.batch_size:
            raise ValueError(f"{rows} rows of prompts for a loop of {self.decoder.batch_size}")
        self.generated.fill_(self.owner.pad_id)
        self.sampled.zero_()
        self.valid.zero_()
        self.valid[:, :prompt] = valid
        self.positions.copy_(valid.sum(-1))
        self.live.copy_(self.rows)
        torch.ge(self.rows, real, out=self.finished)
        self.flagged.zero_()
        self.count.zero_()
        self.recorded = 0
        self.start.fill_(prompt)
        self.draw.set(s, eos)
        self.logprobs = s.logprobs
        if s.stop and candidates is not None:
            self.candidates.copy_(candidates)
        else:  # no stop strings: no row is ever flagged
            self.candidates.zero_()

    @torch.no_grad()
    def first(self, logits: torch.Tensor) -> None:
        """Token 0 of every row from the prefill's logits (rows, V), uncompiled (once a generation)."""
        self._record(logits, self.rows)
        self.recorded += 1

    @torch.no_grad()
    def step(self, rows: int, width: int) -> None:
        """The next token of the cache's first ``rows`` rows, attending to its first ``width`` columns (the newest
        token's column among them): one call, compiled when the decoder is; nothing read back, nothing copied in."""
        if rows > self.decoder.batch_size or width > self.decoder.capacity:
            raise ValueError(
                f"a step of {rows} rows × {width} columns does not fit a "
                f"{self.decoder.batch_size}×{self.decoder.capacity} cache"
            )
        row_ids, column_ids = self.rows[:rows], self.columns[:width]  # their shapes carry (rows, width)
        if self.decoder.compiled:
            if self.decoder.varying:  # one compiled step for every (rows, width), not one each
                torch._dynamo.maybe_mark_dynamic(row_ids, 0)
                torch._dynamo.maybe_mark_dynamic(column_ids, 0)
            torch.compiler.cudagraph_mark_step_begin()
        self._step(row_ids, column_ids)
        self.recorded += 1

    def read_back(self, rows: int, since: int, until: int) -> tuple[list[list[int]], list[bool], list[bool]]:
        """The one host sync of a stop check: every chunk row's tokens ``since`` … ``until`` − 1, and the finished
        and flagged flags of the first ``rows`` cache rows, in one copy; the flags are then cleared (on the device)."""
        width = until - since
        packed = torch.cat(
            [
                self.generated[:, since:until].flatten(),
                self.finished[:rows].long(),
                self.flagged[:rows].long(),
            ]
        ).tolist()
        self.flagged.zero_()
        tokens = [packed[i : i + width] for i in range(0, width * self.decoder.batch_size, width)]
        flags = packed[width * self.decoder.batch_size :]
        return tokens, [bool(x) for x in flags[:rows]], [bool(x) for x in flags[rows:]]

    def finish_rows(self, rows: list[int]) -> None:
        """Mark cache ``rows`` finished (a stop string ended them)."""
        if rows:
            self.finished[torch.tensor(rows, device=self.finished.device)] = True

    @torch.no_grad()
    def compact(self, keep: torch.Tensor) -> None:
        """Cache rows ``keep`` (n,) move to rows [0, n), as :meth:`StaticKVDecoder.compact` moves their cache."""
        for buffer in (self.valid, self.positions, self.live, self.finished, self.flagged):
            buffer[: keep.shape[0]] = buffer.index_select(0, keep)

    def results(self, real: int, steps: int) -> tuple[list[list[int]], list[list[float]] | None]:
        """The first ``real`` chunk rows' ``steps`` tokens (and log-probs, if drawn with them)."""
        generated = self.generated[:real, :steps].tolist()
        return generated, self.sampled[:real, :steps].tolist() if self.logprobs else None

    def free(self) -> None:
        """Free the buffers' memory now (see :meth:`StaticKVDecoder.free`); the loop cannot run after."""
        for buffer in self._buffers():
            buffer.untyped_storage().resize_(0)

    # ------------------------------------------------------------------------------- on the device

    def _token(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Decode each of the first b = len(rows) cache rows' newest token (token count − 1, at cache column
        start + count − 1), attending to the first W = len(columns) columns, then draw and record token count."""
        b = rows.shape[0]
        newest = self.count - 1  # (1,)
        slot = self.start + newest
        tokens = self.generated[self.live[:b], newest]
        # each row attends to its prompt's columns and to every generated column up to the newest
        attend = self.valid[:b, : columns.shape[0]] | ((columns >= self.start) & (columns <= slot))
        logits = self.decoder._decode_step(tokens, self.positions[:b] + newest, slot, attend)
        self._record(logits, rows)

    def _record(self, logits: torch.Tensor, rows: torch.Tensor) -> None:
        """Draw token ``count`` of the first b = len(rows) cache rows from their fp32 logits (b, V) and record it."""
        b = rows.shape[0]
        compiling = torch.compiler.is_compiling()  # uncompiled, what depends on settings is decided on the host
        count, live, finished = self.count, self.live[:b], self.finished[:b]
        drawn = self.owner._sample(logits, self.draw, count if compiling else self.recorded)
        token = torch.where(finished, self.owner.pad_id, drawn)
        self.generated.index_put_((live, count), token)
        if compiling or self.logprobs:  # the raw log-softmax at the drawn token (temperature 1, before top-p)
            picked = logits.gather(-1, token[:, None]).squeeze(-1)
            self.sampled.index_put_((live, count), picked - torch.logsumexp(logits, dim=-1))
        self.finished.index_put_((rows,), finished | self.draw.eos[token])
        self.flagged.index_put_((rows,), self.flagged[:b] | self.candidates[token])
        self.count.add_(1)
