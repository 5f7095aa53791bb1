"""transformers rollout backend: a static-KV-cache decode loop (or ``model.generate``); vLLM's semantics.

For machines without vLLM (CPU boxes, CI, the GPU machine of the benchmarks) and as a reference to
check the vLLM backend against. See ``a5core.engines`` for the shared semantics; how this backend gets there:

- Prompts are repeated ``n`` times (greedy: generated once, then copied) and generated in chunks of
  ``batch_size`` sequences, each chunk left-padded.
- Llama-family models (Llama, Qwen2, Mistral without sliding window) decode with
  :class:`a5core.engines.static_decode.StaticKVDecoder`: a preallocated KV cache and, on CUDA, each
  decode step captured once as a CUDA graph (``torch.compile``, mode ``reduce-overhead``); chunks are
  then padded to ``batch_size`` rows and the cache capacity rounded up, so shapes repeat and compile once.
  That decoder and its cache stay between calls until :meth:`HFEngine.release_memory` drops them (a
  training pass in the same process that ran out of memory asks it to).
  A token is one call (:class:`a5core.engines.token_loop.TokenLoop`, compiled with the decode step: one CUDA
  graph a token): decode, then draw — temperature (by the Gumbel-max trick, :func:`gumbel_max_sample`),
  top-p (the smallest set of tokens reaching ``top_p``, through ``multinomial``), EOS masked during the first
  ``min_tokens`` tokens —, record the token (and its log-prob), pad finished rows, mark rows that drew EOS; its
  state stays on the device, and nothing is read back or copied in a token. Every ``STOP_CHECK_EVERY`` steps
  the loop reads back, in one copy, the new tokens and which rows are done (EOS) or may have completed a stop
  string, and ends when all are. With ``shrink`` (the default) a step attends only to the filled
  cache columns, and a read-back that finds at most half the running rows unfinished halves the rows
  the loop runs.
  Other models use ``model.generate`` with a fresh generation config (the model's own
  ``generation_config`` sampling defaults, such as top-k 50 or a repetition penalty, are not applied
  either way) and a stopping criterion that ends a row when a stop string completes in its
  newest token.
- Stop strings: each finished row's text is cut at the first stop string that completes after its
  first ``min_tokens`` tokens, its ``token_ids`` after the token that completes it. To find rows that
  may have stopped, only rows whose new tokens can complete a stop string are decoded: a token can
  only if its own text holds a stop string's last character, or a U+FFFD (a byte fragment, which may
  complete a multi-byte character). The engine builds that vocabulary table once per set of stop
  strings (one batch decode of the vocabulary); if a stop string ends in whitespace, which a decoder
  may drop from a lone token, every row is decoded.
- ``seed``: the whole call runs under ``torch.manual_seed(seed)`` in a forked RNG (the global RNG is
  left as it was); without a seed the global RNG is used.
- Log-probs: log-softmax(logits)[token] in fp32 for each generated token (raw distribution, temperature 1,
  before top-p), the quantity ``a5core.policy.causal_lm.get_response_log_probs`` computes: the static loop takes them
  from the very logits each token was drawn from (the engine's own numerics, at the cost of one logsumexp a
  step); ``model.generate`` (other architectures) by one teacher-forced forward pass after generation.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence
from typing import Any

import torch

from a5core.engines.engine import Completion, SamplingSettings, check_prompts, resolve_dtype
from a5core.engines.static_decode import StaticKVDecoder, supports
from a5core.engines.token_loop import Draw, TokenLoop, candidate_table, eos_table
from a5core.policy.causal_lm import LOGPROB_CHUNK_TOKENS, checkpoint_name, load_policy, pad_id_of, token_log_probs
from a5core.runtime import progress

STOP_CHECK_EVERY = 16  # decode steps between read-backs of which rows are done (static loop)
CAPACITY_STEP = 256  # the static cache's capacity (when compiled) and the attended width are multiples of this
ROW_HALVINGS = 4  # a chunk's running rows halve at most this many times as rows finish (``shrink``)


def _round_up(n: int) -> int:
    """``n`` rounded up to a multiple of ``CAPACITY_STEP``."""
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def gumbel_max_sample(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """One draw per row from softmax(logits / temperature): (B, V) → (B,). The Gumbel-max trick,
    argmax(logits / T − log(−log U)) with U uniform on [0, 1), draws from exactly that distribution in one
    pass over the logits (fused into one kernel when compiled), where softmax then ``multinomial`` take
    several (``benchmarks/RESULTS.md``, "Gumbel-max sampling"). A row's −inf logits
    (a masked EOS) are never drawn; U = 0 gives −inf noise, never drawn either."""
    return (logits / temperature - torch.log(-torch.log(torch.rand_like(logits)))).argmax(-1)


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

    def __init__(
        self, decode, stops: Sequence[str], prompt_len: int, min_tokens: int, candidates: torch.Tensor | None = None
    ):
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
        for row, tail in zip(rows, window.tolist(), strict=True):
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
    """Rollouts with ``transformers`` ``generate``; see ``a5core.engines`` for the shared semantics.

    ``model``: a causal LM (its own copy: ``load_weights`` writes into it; or the policy itself, then
    ``load_weights`` is a no-op); ``tokenizer``: its tokenizer; ``batch_size``: sequences decoded
    together (prompts × n are chunked). ``static_cache``: use the static-KV-cache loop (default: when the
    architecture is supported); ``compile``: capture its decode step as a CUDA graph (default: on CUDA);
    ``shrink``: in the static loop, attend to the filled cache columns only and run fewer rows as rows
    finish (see ``_decode_static``; False: every step runs the whole chunk over the whole cache). On by
    default, compiled or not: faster whenever rows end at different lengths, as real responses do; full size
    is faster only when every row runs to the same length (shrinking changes graphs as its width grows and
    copies the mask each step; ``docs/gpu.md``, ``benchmarks/RESULTS.md``, "shrinking by default").
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 64,
        static_cache: bool | None = None,
        compile: bool | None = None,
        shrink: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if static_cache and not supports(model):
            raise ValueError(f"static_cache=True needs a Llama-family model, not {type(model).__name__}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.static_cache = supports(model) if static_cache is None else static_cache
        self.compile = self.static_cache and (model.device.type == "cuda" if compile is None else compile)
        self.shrink = shrink
        self._decoder: StaticKVDecoder | None = None  # kept between calls when compiled (its graph too)
        self._loop: TokenLoop | None = None  # the kept decoder's token loop (its compiled step: one graph a token)
        self._decoding = 0  # static-cache generations in progress (release_memory frees no cache in use)
        # temperature sampling (Gumbel-max): compiled inside the token step when that is (one pass over the logits)
        self._temperature_draw = gumbel_max_sample
        self.pad_id = pad_id_of(tokenizer)
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = sorted(set(eos))
        self._token_texts: list[str] | None = None  # each token id decoded alone, built on first need
        self._candidates: dict[tuple[str, ...], torch.Tensor | None] = {}
        self._tables: dict[Any, torch.Tensor] = {}  # the token loop's (V,) tables: EOS ids, stop candidates

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        batch_size: int = 64,
        static_cache: bool | None = None,
        compile: bool | None = None,
    ) -> HFEngine:
        """Load model and tokenizer from a local directory or hub id (no remote code)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = resolve_dtype(dtype, torch.device(device).type)
        policy, tokenizer = load_policy(model, dtype=torch_dtype, device=device)
        return cls(policy, tokenizer, batch_size=batch_size, static_cache=static_cache, compile=compile)

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
            self._candidates[stops] = (
                None if flags is None else torch.tensor(flags, dtype=torch.bool, device=self.model.device)
            )
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
                tokens = sum(len(c.token_ids) for c in completions)
                elapsed = max(sequences.format_dict["elapsed"], 1e-9)
                sequences.set_postfix_str(f"output: {tokens / elapsed:.1f} toks/s", refresh=False)
                sequences.update(len(completions) - sequences.n)
        groups = [completions[i * copies : (i + 1) * copies] for i in range(len(prompts))]
        return [group * sampling.n for group in groups] if sampling.greedy else groups

    def _generate_batch(self, prompts: list[str], s: SamplingSettings) -> list[Completion]:
        device = self.model.device
        enc = self.tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        input_ids, attention_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        sampled = None  # the sampler's own log-probs (the static loop records them as it draws)
        if self.static_cache:
            self._decoding += 1  # before the decoder is read: see release_memory
            try:
                generated, sampled = self._decode_static(input_ids, attention_mask, s)
            finally:
                self._decoding -= 1
        else:
            generated = self._decode_with_generate(input_ids, attention_mask, s)
        rows = self._finish_all(generated, s)
        if s.logprobs:
            completed = [ids for _, ids, _ in rows]
            log_probs = (
                [lp[: len(ids)] for lp, ids in zip(sampled, completed, strict=True)]
                if sampled is not None
                else self._log_probs(input_ids, attention_mask, completed)
            )
            return [
                Completion(text, tuple(ids), why, tuple(lp))
                for (text, ids, why), lp in zip(rows, log_probs, strict=True)
            ]
        return [Completion(text, tuple(ids), why) for text, ids, why in rows]

    # ------------------------------------------------------------------------ static-cache loop

    def _static_decoder(self, rows: int, needed: int) -> StaticKVDecoder:
        """A decoder for ``rows`` × ``needed`` positions; compiled ones are kept while they fit (and until
        :meth:`release_memory`, which another thread may call meanwhile: the decoder returned is read once)."""
        if not self.compile:
            return StaticKVDecoder(self.model, rows, needed)
        decoder = self._decoder
        if decoder is None or decoder.capacity < needed:
            self._decoder = decoder = None  # free the old cache first
            decoder = StaticKVDecoder(self.model, self.batch_size, _round_up(needed), compile=True, varying=self.shrink)
            self._decoder = decoder
        return decoder

    def _token_loop(self, decoder: StaticKVDecoder) -> TokenLoop:
        """``decoder``'s token loop: its device state and (compiled) token step; kept with a kept decoder."""
        loop = self._loop
        if loop is None or loop.decoder is not decoder:
            loop = TokenLoop(decoder, self)
            if self.compile:
                self._loop = loop
        return loop

    def _table(self, key: Any, vocab: int) -> torch.Tensor:
        """The token loop's (``vocab``,) bool table on the model's device: ``"eos"``, the EOS ids; a tuple of stop
        strings, the tokens that may complete one (:func:`stop_candidates`). Built once each."""
        if (key, vocab) not in self._tables:
            device = self.model.device
            if key == "eos":
                table = eos_table(self.eos_ids, vocab, device)
            else:
                table = candidate_table(self._stop_candidates(key), vocab, device)
            self._tables[key, vocab] = table
        return self._tables[key, vocab]

    def release_memory(self) -> bool:
        """Drop the compiled decoder kept between calls, its KV cache of ``batch_size`` × capacity positions
        (at 1.5B, 256 × 1,280 positions: 8.8 GiB), so that a training pass can use that memory; the next
        ``generate`` builds it again (its graphs recorded anew, not recompiled). True if one was kept.
        The cache's memory is freed even where something else still refers to it (on CUDA, the compiled step's
        graphs may: a GRPO step capped to 40 GiB found the released cache still held); a decoder generating in
        another thread meanwhile is freed when that generation ends."""
        decoder, self._decoder = self._decoder, None  # dropped before the check: a generation starting now builds anew
        loop, self._loop = self._loop, None
        if decoder is None:
            return False
        if not self._decoding:
            decoder.free()
            if loop is not None:
                loop.free()
        del decoder, loop
        gc.collect()  # a compiled decoder refers to itself (its compiled step is its bound method): a cycle
        return True

    def _decode_static(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, s: SamplingSettings
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Token ids generated for each row of left-padded prompts (B, P), trailing padding included, and (with
        ``s.logprobs``) each token's log-prob under the logits it was drawn from (raw: temperature 1, before
        top-p), in fp32: what the sampler saw, with no second forward pass.

        Each token is one :meth:`TokenLoop.step` (one CUDA graph when compiled), which reads nothing back; every
        ``STOP_CHECK_EVERY`` steps one read-back (:meth:`TokenLoop.read_back`) brings the new tokens and which rows
        are finished or flagged to the host, which decodes the flagged rows for stop strings. With ``shrink``, each
        decode step attends to the filled cache columns only (rounded up to a multiple of ``CAPACITY_STEP``), and
        when a read-back finds at most half the running rows unfinished, those move to the front of the cache and
        the loop runs half as many rows (down to 1/``2**ROW_HALVINGS`` of the chunk, and 2 rows): finished rows stop
        costing. Row order never changes what a row generates, except through the sampler's random draws (seeded
        runs stay reproducible)."""
        real, prompt_len = input_ids.shape
        decoder = self._static_decoder(real, prompt_len + s.max_tokens)
        loop = self._token_loop(decoder)
        rows = decoder.batch_size
        valid = attention_mask.bool()
        if rows > real:  # pad the chunk with copies of its last row, finished from the start
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(rows - real, -1)])
            valid = torch.cat([valid, valid[-1:].expand(rows - real, -1)])
        # the generation's bookkeeping, on the device, once: off the per-token path
        loop.begin(
            valid, real, s, self._table("eos", loop.vocab), self._table(tuple(s.stop), loop.vocab) if s.stop else None
        )
        loop.first(decoder.prefill(input_ids, valid))  # token 0, from the prefill's logits
        live = list(range(rows))  # the chunk row each running cache row decodes (the host's copy of loop.live)
        tokens: list[list[int]] = [[] for _ in range(rows)]  # each chunk row's tokens read back so far
        steps = 1
        while steps < s.max_tokens:
            if steps % STOP_CHECK_EVERY == 0:
                live = self._stop_check(loop, tokens, live, steps, s)
                if not live:
                    break
            width = min(decoder.capacity, _round_up(prompt_len + steps)) if self.shrink else decoder.capacity
            loop.step(len(live), width)
            steps += 1
        return loop.results(real, steps)

    def _stop_check(
        self, loop: TokenLoop, tokens: list[list[int]], live: list[int], steps: int, s: SamplingSettings
    ) -> list[int]:
        """The loop's one host sync every ``STOP_CHECK_EVERY`` tokens, after ``steps`` tokens: read back the new
        tokens (appended to ``tokens``, by chunk row) and which of the running cache rows (``live``: their chunk rows)
        are finished or flagged; mark the flagged rows whose text now holds a stop string finished; with ``shrink``,
        when at most half the running rows are unfinished, move them to the front, topped up with finished ones, and
        run half as many. Returns the chunk rows of the cache rows to run on, [] when every row is finished."""
        running = len(live)
        new, finished, flagged = loop.read_back(running, len(tokens[0]), steps)
        for row, ids in zip(tokens, new, strict=True):
            row.extend(ids)
        ended = [
            row
            for row in range(running)
            if flagged[row] and not finished[row] and self._stop_cut(tokens[live[row]], None, s) is not None
        ]
        loop.finish_rows(ended)
        for row in ended:
            finished[row] = True
        if all(finished):
            return []
        half = running // 2
        unfinished = [row for row in range(running) if not finished[row]]
        smallest = max(2, loop.decoder.batch_size >> ROW_HALVINGS)  # a compiled step would specialise on 1 row
        if self.shrink and half >= smallest and len(unfinished) <= half:
            keep = (unfinished + [row for row in range(running) if finished[row]])[:half]
            index = torch.tensor(keep, dtype=torch.long, device=loop.rows.device)
            loop.decoder.compact(index)
            loop.compact(index)
            live = [live[row] for row in keep]
        return live

    def _sample(self, logits: torch.Tensor, draw: Draw, count: int | torch.Tensor) -> torch.Tensor:
        """Token number ``count`` (an int, or a (1,) tensor on the device) of each row from fp32 logits (B, V) → (B,):
        greedy, temperature sampling (Gumbel-max: one pass over the logits, compiled inside the token step), or
        temperature + top-p sampling; EOS (``draw.eos``) is never drawn while ``count`` < ``draw.min_tokens``. Reads
        nothing back: traced into the compiled token step, where greedy and temperature sampling are one code (the
        greedy draw computes the noise and takes the plain argmax: one compilation for both, not two)."""
        if torch.compiler.is_compiling() or not isinstance(count, int):
            blocked = draw.eos & (count < draw.min_tokens)  # (V,): the EOS ids, or none once min_tokens are reached
            logits = torch.where(blocked, float("-inf"), logits)
        elif count < draw.hold_eos:  # uncompiled, with the host's count: no pass over the logits once it is past
            logits = torch.where(draw.eos, float("-inf"), logits)
        if draw.nucleus:
            probs = torch.softmax(logits / draw.temperature, dim=-1)
            # keep the most probable tokens until their mass reaches top_p
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= draw.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            return torch.multinomial(probs, 1).squeeze(-1)
        if torch.compiler.is_compiling():
            return torch.where(draw.sampling, self._temperature_draw(logits, draw.temperature), logits.argmax(-1))
        return logits.argmax(-1) if draw.greedy else self._temperature_draw(logits, draw.temperature)

    # ------------------------------------------------------------------ transformers' generate

    def _decode_with_generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, s: SamplingSettings
    ) -> list[list[int]]:
        """Token ids generated for each row by ``model.generate``, trailing padding included."""
        from transformers import GenerationConfig, StoppingCriteriaList

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
            criteria.append(
                _StopOnStrings(self._decode, s.stop, prompt_len, s.min_tokens, self._stop_candidates(tuple(s.stop)))
            )
        # Swap in a neutral generation config so the model's sampling defaults are not merged in.
        saved, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config, stopping_criteria=criteria
            )
        finally:
            self.model.generation_config = saved
        return out[:, prompt_len:].tolist()

    def _finish_all(self, generated: list[list[int]], s: SamplingSettings) -> list[tuple[str, list[int], str]]:
        """(text, token_ids, finish_reason) of each generated row (which may carry trailing padding): each cut after
        its first EOS, then all decoded in one call (a fast tokenizer decodes a batch at once), then cut at stop
        strings (:meth:`_finish`)."""
        eos, rows = set(self.eos_ids), []
        for ids in generated:
            end = next((i + 1 for i, token in enumerate(ids) if token in eos), None)
            rows.append((ids, "length") if end is None else (ids[:end], "stop"))
        if not rows:
            return []
        texts = self.tokenizer.batch_decode(
            [ids for ids, _ in rows], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return [self._finish(ids, finish, text, s) for (ids, finish), text in zip(rows, texts, strict=True)]

    def _finish(self, ids: list[int], finish: str, text: str, s: SamplingSettings) -> tuple[str, list[int], str]:
        """(text, token_ids, finish_reason) of one row cut after its first EOS (``finish`` "stop"; else "length"),
        ``text`` its decoding: cut at the first stop string that counts."""
        cut = self._stop_cut(ids, text, s)
        if cut is not None:
            return cut[0], cut[1], "stop"
        if finish == "length" and len(ids) < s.max_tokens:  # the stopping criterion and this cut disagree
            raise RuntimeError(
                f"bug: generation ended after {len(ids)} of {s.max_tokens} tokens without EOS or stop string"
            )
        return text, ids, finish

    def _stop_cut(self, ids: list[int], text: str | None, s: SamplingSettings) -> tuple[str, list[int]] | None:
        """(text, token_ids) cut after the first stop string completing past ``min_tokens`` tokens, or None.
        ``text`` is ``ids`` decoded (None: decoded here, if needed)."""
        if not s.stop or len(ids) <= s.min_tokens:  # no stop string completes past min_tokens in min_tokens tokens
            return None
        if text is None:
            text = self._decode(ids)
        boundary = len(self._decode(ids[: s.min_tokens])) if s.min_tokens else 0
        end = _stop_end(text, s.stop, boundary)
        if end is None:
            return None
        lo, hi = max(s.min_tokens, 1), len(ids)  # the fewest tokens whose text reaches the stop's end
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return text[:end], ids[:lo]

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
                input_ids=input_ids[rows],
                attention_mask=attention_mask[rows],
                position_ids=position_ids[rows],
                logits_to_keep=width + 1,
            ).logits[:, :-1]
            pieces.append(token_log_probs(logits, response[rows]))
        values = torch.cat(pieces)
        return [values[row, : len(ids)].tolist() for row, ids in enumerate(completions)]

    # --------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def load_weights(self, policy_model: torch.nn.Module) -> None:
        """Copy ``policy_model``'s parameters and buffers into the engine's model (any device/dtype).

        A no-op when the policy *is* the engine's model (adapted with LoRA or not: ``policy_model`` may be
        its :class:`a5core.policy.lora.MergedPolicy`). Names must match (DDP ``module.`` and ``torch.compile``
        ``_orig_mod.`` prefixes are stripped).
        """
        if getattr(policy_model, "policy", policy_model) is self.model:
            return
        state = {checkpoint_name(name): tensor for name, tensor in policy_model.state_dict().items()}
        self.model.load_state_dict(state, strict=True)
