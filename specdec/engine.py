"""`specdec.wrap(model)`: speculative generation with a target runner, a drafter and acceptance rules."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from specdec.draft import DraftBlock
from specdec.draft.base import check_block
from specdec.tensors import outside_inference
from specdec.verify import sample_token

from . import cpu_linear, generation
from .build import EngineParts
from .config import SpecConfig
from .runner import HybridRunner, index_tensor
from .stats import SpecStats


class Contexts(list):
    """The drafters' view of each row: a list of `[n]` token tensors (prompt, committed tokens, the anchor
    last) that also carries the same tokens as host lists in `.host`, so a drafter that works on the host
    (prompt lookup) needs no device read."""

    def __init__(self, tensors, host: list[list[int]]):
        super().__init__(tensors)
        self.host = host


class Observed(list):
    """`observe`'s per-row tensors (a list of `[n_b, ...]`) that also carries their counts as a device tensor
    `.counts [B]` (long) and, when the rows are views of one right-padded batch `[B, M, ...]` (M >= every n_b),
    that batch (`.padded`, else None): a drafter indexes its device buffers by the counts and reads the batch
    whole (`specdec.draft.base.padded`), with no host-to-device copy and no op per row."""

    def __init__(self, tensors, counts: torch.Tensor, padded: torch.Tensor | None = None):
        super().__init__(tensors)
        self.counts = counts
        self.padded = padded

    @classmethod
    def rows_of(cls, batch: torch.Tensor, sizes: list[int], counts: torch.Tensor) -> "Observed":
        """The first `sizes[b]` entries of each row of `batch [B, M, ...]`, as views, with the batch itself."""
        return cls([batch[i, :n] for i, n in enumerate(sizes)], counts, batch)


@dataclass
class GenerateOutput:
    """What `generate` returns. `sequences [B, W]`: transformers' layout, the prompt block as the caller passed it
    (`[B, P]`, pads included), then each row's new tokens right-padded with the pad id (a list of prompts of
    different lengths: each prompt, then its new tokens, right-padded). `new_token_counts[b]`: row b's new tokens;
    `finish_reasons[b]`: 'stop' (it ended on an eos id) or 'length' (it reached max_new_tokens), OpenAI's terms."""

    sequences: torch.Tensor
    stats: SpecStats
    new_token_counts: list[int]
    finish_reasons: list[str]


@dataclass
class _Run:
    """One `generate` call, as its admissions and rounds read it: how it decodes (`sampling`, `max_new` per request,
    the stop ids `eos`), its sampling streams (`gen`: first tokens and acceptance; `draft_gen`: the drafter's, its
    own under tensor parallelism), its counters and streamer, and its requests by index: prompts `[P]` on the
    target's device, host histories (prompt, committed tokens, the anchor last) and new tokens."""

    sampling: object
    max_new: int
    eos: set[int]
    gen: torch.Generator | None
    draft_gen: torch.Generator | None
    stats: SpecStats
    streamer: object
    prompts: list[torch.Tensor]
    hist: list[list[int]]
    out: list[list[int]]
    worst: list[int]  # each request's worst case in KV tokens: prompt, new tokens and a verify window


class _Lanes:
    """The requests in flight of one `generate` call, one per lane (a lane is a drafter row, < max_batch_size):
    target slot (None: free) and the request's host lists (`hist`, `out`) per lane; device token buffer
    `tok [L, W]`, lengths `lens [L]` and anchors `anchors [L]`."""

    def __init__(self, L: int, tok: torch.Tensor):
        self.slot: list = [None] * L
        self.hist: list = [None] * L
        self.out: list = [None] * L
        self.tok = tok
        self.lens = torch.zeros(L, dtype=torch.long, device=tok.device)
        self.anchors = torch.zeros(L, dtype=torch.long, device=tok.device)

    def held(self) -> list[int]:
        return [l for l, s in enumerate(self.slot) if s is not None]


class SpecEngine(EngineParts):
    """Lossless speculative decoding for one target model (see `specdec.wrap`): the request loop of `generate`.
    What an engine is built from (checks, drafter, target runner, memory plan, round step) is `EngineParts`."""

    @torch.inference_mode()
    @cpu_linear.engaged()
    def generate(self, input_ids=None, generation_config=None, *, attention_mask=None, seed: int | None = None,
                 streamer=None, **kwargs) -> GenerateOutput:
        """Generate new tokens per prompt, as transformers' `model.generate(**inputs)`: greedy output equals the
        target's own greedy decode and sampled output follows the target's distribution.

        input_ids: a `[B, P]` tensor with its `attention_mask` (left or right padding; pads are not prompt tokens),
        a tokenizer's output passed whole, a `[P]` tensor, a list of 1-D sequences of any lengths, or one list of ints
        (`specdec.generation.read_prompts`). generation_config and the keywords (do_sample, temperature, top_k, top_p,
        max_new_tokens, max_length, eos_token_id: an id, a list or None for no early stop, pad_token_id) over the
        model's own `generation_config`, as transformers merges them, with its warnings
        (`specdec.generation.resolve_settings`). seed: the sampling stream's seed. streamer: a transformers streamer
        (one prompt), fed as tokens are committed.

        Any number of prompts: at most `max_batch_size` run at once (the lanes), the rest wait in order and
        take a lane as soon as one is free (continuous batching: a finished request's lane is refilled before
        the next round, so the batch stays full while requests wait). Output rows follow the input order.

        Runs under `torch.inference_mode` (no autograd bookkeeping per op); what the engine keeps across calls stays
        normal tensors, so its runner and drafter can be driven outside it, and `sequences` is a normal tensor. Runs
        inside `cpu_linear.engaged()`: the oneDNN copies of a CPU model's weights are checked against the weights at
        their first use in each call, so weights updated between calls (however: an optimizer step, a write through
        `.data`) are the ones used."""
        t0 = time.perf_counter()
        extras = {k: kwargs.pop(k) for k in generation.TOKENIZER_EXTRAS if k in kwargs}
        generation.check_call(generation_config, kwargs)
        own = getattr(self.model, "generation_config", None)
        merged = generation.merged_config(own, generation_config, kwargs)
        generation.warn_ignored(merged)
        eos = generation.eos_ids(merged.eos_token_id)
        given, prompts, host_prompts = self._prompts(input_ids, attention_mask, extras=extras,
                                                     pad_token_id=merged.pad_token_id, eos=eos)
        settings = generation.resolve_settings(merged, own, generation_config, kwargs, eos=eos, prompts=given,
                                               max_length=self.max_length, fallback_pad=self.pad_token_id)
        N = len(prompts)
        sampling, max_new_tokens, eos_set = settings.sampling, settings.max_new_tokens, settings.eos
        longest = max(p.numel() for p in prompts)
        if longest + max_new_tokens > self.max_length:
            raise ValueError(f"max_new_tokens: prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_length {self.max_length}")
        if self.runner.num_free < 1:
            raise ValueError("max_batch_size: no free slot (every one is held by a running generate call)")
        if streamer is not None and N != 1:
            raise ValueError("streamer: streaming supports a single prompt")
        gen = None
        if self.tp is not None and sampling.do_sample:  # one sampling stream on every rank
            seed = self.tp.agree_seed(seed)
        if seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        # with tp only rank 0 drafts: its drafter draws from a stream of its own, the acceptance from `gen` on every
        # rank alike
        draft_gen = gen if self.tp is None or gen is None else \
            torch.Generator(device=self.runner.device).manual_seed(seed + 1)
        stats = SpecStats()
        L = min(N, self.runner.num_free)
        dev = self.runner.device
        out_tokens: list[list[int]] = [[] for _ in range(N)]
        hist = [list(p) for p in host_prompts]  # host mirror of every request's tokens (prompt, committed, anchor)
        worst = [p.numel() + max_new_tokens + self.target.num_verify_tokens for p in prompts]
        run = _Run(sampling, max_new_tokens, eos_set, gen, draft_gen, stats, streamer, prompts, hist, out_tokens,
                   worst)
        # per lane: its target slot and its request's host lists; the device token buffer, lengths and anchors
        # are per lane too, and rounds update them without a host round trip
        W = longest + max_new_tokens + 1
        lanes = _Lanes(L, torch.full((L, W), self.pad_token_id, dtype=torch.long, device=dev))
        self.lane_slots = lanes.slot
        waiting = list(range(N - 1, -1, -1))  # requests not yet admitted, next one last
        free, active = list(range(L)), []  # lanes without a request; lanes whose request goes on
        try:
            while True:
                ids, reqs = [], []  # admitted in order while lanes are free and their pages fit
                # (each check sizes every chosen request again: an eviction may take the prefix one would share)
                while free and waiting:
                    if self.runner.fits([self._fresh(worst[r], hist[r]) for r in reqs + [waiting[-1]]]):
                        ids.append(free.pop(0))
                        reqs.append(waiting.pop())
                    elif self.prefix_cache is None or not self.prefix_cache.evict_one():  # entries hold pages too
                        break
                if ids:
                    going = self._admit(lanes, ids, reqs, run)
                    ended = [l for l in ids if l not in going]  # ended at their first token
                    active = sorted(active + going)
                    if ended:
                        self._retire(lanes, ended, publish=True)
                        free = sorted(free + ended)
                        continue
                if not active:
                    if waiting:  # cannot happen: the page pool holds a request at max_length (`memory.pages_within`)
                        raise RuntimeError(f"memory: request {waiting[-1]} ({worst[waiting[-1]]} tokens) does not fit "
                                           f"the KV page pool even with nothing running")
                    break
                self._round(active, lanes, run)
                done = [l for l in active if self._done(lanes.out[l], max_new_tokens, eos_set)]
                if done:
                    active = [l for l in active if l not in done]
                    self._retire(lanes, done, publish=True)
                    free = sorted(free + done)
        except BaseException:  # anything (KeyboardInterrupt included) after slots were taken: drop the open
            self._abort(lanes.held())  # round everywhere; the finally clause returns the slots
            raise
        finally:
            self.lane_slots = []
            try:
                self._retire(lanes, lanes.held())
            finally:
                if streamer is not None:
                    streamer.end()
        stats.timings["total"] = time.perf_counter() - t0
        pad = settings.pad_token_id
        counts = [len(o) for o in out_tokens]
        with outside_inference():  # the caller's tensor: a normal one, as transformers' generate returns
            if given.block is not None:  # the prompt block as given, then the new tokens (transformers' layout)
                new = torch.tensor([o + [pad] * (max(counts) - len(o)) for o in out_tokens], dtype=torch.long)
                seqs = torch.cat([given.block.detach().cpu().long(), new], 1)
            else:  # prompts of different lengths: each followed by its new tokens, right-padded
                rows_out = [p + o for p, o in zip(host_prompts, out_tokens)]
                width = max(len(r) for r in rows_out)
                seqs = torch.tensor([r + [pad] * (width - len(r)) for r in rows_out], dtype=torch.long)
        reasons = ["stop" if o and o[-1] in eos_set else "length" for o in out_tokens]
        return GenerateOutput(seqs, stats, counts, reasons)

    def _admit(self, lanes: "_Lanes", ids: list[int], reqs: list[int], run: "_Run") -> list[int]:
        """Start requests `reqs` in the free lanes `ids`: take slots, prefill the prompts together, draw each
        request's first token (one readback), tell the drafter; -> the lanes whose request goes on."""
        slots = self.runner.alloc(len(ids))
        for l, r, s in zip(ids, reqs, slots):
            lanes.slot[l], lanes.hist[l], lanes.out[l] = s, run.hist[r], run.out[r]
        ps = [run.prompts[r] for r in reqs]
        sizes = [p.numel() for p in ps]
        # each request's KV pages for its worst case, reserved before its prefill (after the shared pages of its
        # cached prefix): no round of it takes pages (CUDA graphs replay none)
        worst = [run.worst[r] for r in reqs]
        if self.prefix_cache is None:
            self.runner.reserve(slots, worst)
        self.drafter.begin(ids, ps)
        t = time.perf_counter()
        capture = tuple(self.drafter.feature_layers)
        lens = torch.tensor(sizes, dtype=torch.long, device=lanes.tok.device)
        run.stats.prompt_tokens += sum(sizes)
        cached = self._cached
        if cached is not None:  # each prompt from its deepest cached prefix
            last, feats, hit = cached.start(slots, ps, [run.hist[r] for r in reqs], worst, capture)
            run.stats.cached_tokens += hit
            if "hidden" not in feats:  # a drafter that observes no features: zeros, as no memory
                feats["hidden"] = last.new_zeros(()).expand(len(ids), max(sizes), self.runner.hidden_size)
            self.drafter.observe(ids, Observed(ps, lens), Observed.rows_of(feats["hidden"], sizes, lens),
                                 {c: Observed.rows_of(feats[c], sizes, lens) for c in capture})
        elif hasattr(self.runner, "prefill_batch"):  # every prompt in one forward per chunk
            out = self.runner.prefill_batch(slots, ps, capture=capture, last_logits=True)
            last = out.logits[:, 0]
            self.drafter.observe(ids, Observed(ps, lens), Observed.rows_of(out.hidden, sizes, lens),
                                 {c: Observed.rows_of(out.captured[c], sizes, lens) for c in capture})
        else:
            last = []
            for i, (l, s, p) in enumerate(zip(ids, slots, ps)):
                out = self.runner.prefill(s, p, capture=capture)
                last.append(out.logits[0, -1])
                self.drafter.observe([l], Observed([p], lens[i:i + 1]), [out.hidden[0]],
                                     {c: [out.captured[c][0]] for c in capture})
            last = torch.stack(last)  # [k, V]
        finite = torch.isfinite(last).all(1)  # checked after the one readback (a draw from NaN would raise first)
        first = sample_token(torch.where(finite[:, None], last, 0), run.sampling, run.gen)
        back = torch.cat([first[:, None], finite[:, None].long()], 1).tolist()
        for i, (_, ok) in enumerate(back):
            if not ok:
                raise self._nonfinite(last[i], reqs[i], ps[i].numel() - 1)
        run.stats.timings["prefill"] += time.perf_counter() - t
        if run.streamer is not None:
            run.streamer.put(ps[0].cpu())
        lane_t = self._index(ids)
        row = torch.full((len(ids), lanes.tok.shape[1]), self.pad_token_id, dtype=torch.long, device=lens.device)
        row[:, :max(sizes)] = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True, padding_value=self.pad_token_id)
        row[torch.arange(len(ids), device=row.device), lens] = first
        lanes.tok[lane_t] = row
        lanes.lens[lane_t] = lens + 1
        lanes.anchors[lane_t] = first
        going = []
        for i, (l, r) in enumerate(zip(ids, reqs)):
            if not self._emit(run.out[r], [back[i][0]], run):
                going.append(l)
            run.hist[r].extend(run.out[r])
        if cached is not None:  # each prompt's end: an entry, written after the first tokens went out
            for l, P in zip(ids, sizes):
                cached.publish(lanes.hist[l][:P], lanes.slot[l])
        return going

    def _retire(self, lanes: "_Lanes", ids: list[int], *, publish: bool = False) -> None:
        """Requests of lanes `ids` ended (or the call failed): with `publish` (finished requests) their state goes
        to the prefix cache; then the drafter and the runner let go of them."""
        if publish and self._cached is not None:  # at the returned tokens: a round commits nothing past them
            for l in ids:
                s = lanes.slot[l]
                self._cached.publish(lanes.hist[l][:self.runner.length(s)], s)
        try:
            self.drafter.release(ids)
        finally:
            try:
                self.runner.release([lanes.slot[l] for l in ids])
            finally:
                for l in ids:
                    lanes.slot[l] = None

    def _fresh(self, worst: int, tokens: list[int]) -> int:
        """KV tokens a request of `worst` tokens takes in fresh pages: all of them, less the full pages it shares from
        its deepest cached prefix (looked up without counting a hit)."""
        if self.prefix_cache is None:
            return worst
        e = self.prefix_cache.match(tokens, len(tokens) - 1, touch=False)
        page = self.runner.kv.page_size
        return worst - (0 if e is None else e.length // page * page)

    def _index(self, rows: list[int]) -> torch.Tensor:
        """`rows` as a device tensor, built once per distinct list (else a host-to-device copy per round)."""
        return index_tensor(self._row_index, rows, self.runner.device)

    def _round(self, active, lanes: "_Lanes", run: "_Run"):
        """One speculative round of the `active` lanes: draft, verify, accept, one readback, commit, observe.

        Host state per lane: `hist[b]` (prompt + committed tokens, the anchor last) and `out[b]`. Device state:
        the token buffer `tok [L, W]` with lengths `lens [L]`, and `anchors [L]`. The drafter's block is
        checked with one host read; everything the host needs of the round (accepted counts, new tokens,
        path, finiteness of the logits) comes back in one more; nothing else in here reads back.
        With static shapes the verify step sees `[Bk, T]` for the batch bucket Bk >= B (rows past B: the
        null slot, nothing drafted, nothing committed) and T fixed by gamma or the tree's node budget."""
        slots, hist, out_tokens, tok, lens, anchors = lanes.slot, lanes.hist, lanes.out, lanes.tok, lanes.lens, \
            lanes.anchors
        sampling, stats, max_new = run.sampling, run.stats, run.max_new
        B = len(active)
        started = None if self.tp is None else self.tp.collectives
        idx = self._index(active)
        contexts = Contexts([tok[b, :len(hist[b])] for b in active], [hist[b] for b in active])
        static = self.config.static_shapes
        gamma = self.config.gamma_for(self.round_step.bucket(B) if static else B)
        if not static:
            gamma = min(gamma, max(max_new - len(out_tokens[b]) for b in active))
        # a drafter with a static draft step drafts inside the device step (with the verify, in one CUDA graph)
        static_draft = static and getattr(self.drafter, "static_draft", False) and self.tp is None
        t = time.perf_counter()
        if gamma == 0:  # plain decoding: nothing to draft, and no block to check (its check reads back)
            block = DraftBlock.empty(B, self.runner.device)
        else:
            lead = self.tp is None or self.tp.leads
            block = None if static_draft or not lead else \
                self._propose(active, contexts, gamma, run)
            if self.tp is not None:  # rank 0's checked block on every rank
                block = self.tp.share_block(block, B, max(gamma, self.runner.num_verify_tokens - 1))
        stats.timings["draft"] += time.perf_counter() - t
        t = time.perf_counter()
        host_slots = [slots[b] for b in active]
        step = self.round_step.inputs(host_slots, anchors[idx], block, sampling, gamma, rows=active)
        graphed = self.config.cuda_graph and not sampling.do_sample
        res = (self._graphs.verify(step, sampling) if graphed
               else self.round_step.device_step(step, sampling, run.gen, stats))
        host = res.read(B)
        if not all(host.finite):
            raise self._nonfinite_round(res.logits[:B], active, contexts, res.parent)
        stats.record(host.num_drafts, host.num_accepted, host.reached)
        self._cut_at_returned(res, host, [out_tokens[b] for b in active], run)
        (self._graphs.commit if graphed else self.round_step.commit_step)(res, host)
        stats.timings["verify"] += time.perf_counter() - t
        # the device copies follow without a host round trip: token buffer, lengths, anchors
        acc = res.acceptance
        n, path, new = acc.num_accepted[:B], acc.path[:B], acc.tokens[:B]
        j = torch.arange(new.shape[1], device=new.device)
        base = lens[idx]
        pos = (base[:, None] + j[None]).clamp(max=tok.shape[1] - 1)
        keep = j[None] <= n[:, None]
        tok[idx[:, None], pos] = torch.where(keep, new, tok[idx[:, None], pos])
        kept = acc.num_kept[:B]  # tokens each row keeps (anchor included): the lengths' step and `observe`'s counts
        lens[idx] += kept
        anchors[idx] = acc.bonus[:B]
        ids, capture = res.ids[:B], tuple(self.drafter.feature_layers)
        at = path.clamp(min=0)
        kept_ids = ids.gather(1, at)
        hidden = res.hidden[:B]
        kept_h = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
        kept_f = {l: res.captured[l][:B].gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
                  for l in capture}
        sizes = host.num_kept
        self.drafter.observe(active, Observed.rows_of(kept_ids, sizes, kept), Observed.rows_of(kept_h, sizes, kept),
                             {l: Observed.rows_of(f, sizes, kept) for l, f in kept_f.items()})
        for i, b in enumerate(active):
            before = len(out_tokens[b])
            self._emit(out_tokens[b], host.tokens[i], run)
            hist[b].extend(out_tokens[b][before:])
        if self._cached is not None:  # the track boundaries this round passed
            for b, n in zip(active, sizes):
                s = slots[b]
                after = self.runner.length(s)
                for t in self._cached.boundaries(after - n, after):
                    self._cached.publish(hist[b][:t], s, t)
        if started is not None:
            stats.collectives.append(self.tp.collectives - started)

    # ---- failures ----------------------------------------------------------------------------------
    def _propose(self, active, contexts, gamma, run: "_Run") -> DraftBlock:
        """The drafter's block, checked; a drafter that raises (any Exception) or returns a malformed block
        costs speed, never correctness: plain decode this round (an empty block)."""
        B = len(active)
        try:
            block = self.drafter.propose(active, contexts, gamma, sampling=run.sampling, generator=run.draft_gen)
            runner = self.runner
            return check_block(block, B, gamma, device=runner.device, vocab=self._vocab,
                               tree_budget=runner.num_verify_tokens if isinstance(runner, HybridRunner) else None,
                               target=type(runner).__name__)
        except Exception as e:
            what = f"{type(e).__name__}: {e}"
            try:  # drop whatever the drafter left half-done, so its next round starts from committed state
                self.drafter.abort(active)
            except Exception as e2:
                what += f"; its abort failed too ({type(e2).__name__}: {e2})"
            warnings.warn(f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)} failed ({what}); "
                          f"plain decode for this round", RuntimeWarning, stacklevel=4)
            run.stats.drafter_failures += 1
            return DraftBlock.empty(B, self.runner.device)

    def _abort(self, rows: list[int]) -> None:
        """Drop an open round in the target runner (state strategy and KV cache) and in the drafter."""
        try:
            self.runner.abort()
        finally:
            self.drafter.abort(rows)

    def _nonfinite(self, logits: torch.Tensor, row: int, position: int, where: str = "prefill") -> FloatingPointError:
        kinds = [k for k, m in (("nan", logits.isnan()), ("inf", logits.isinf())) if bool(m.any())]
        return FloatingPointError(
            f"target {type(self.model).__name__} returned non-finite logits ({'/'.join(kinds)}) for request row "
            f"{row} at position {position} ({where}); generate stopped before committing anything of it")

    def _nonfinite_round(self, logits, active, contexts, parent) -> FloatingPointError:
        """The first non-finite logit of a verify window `[B, T, V]`: request row, and the sequence position of
        the input token those logits follow (the anchor is at len(context) - 1; tree nodes add their depth)."""
        i, t = (int(x) for x in (~torch.isfinite(logits)).any(-1).nonzero()[0])
        depth = t
        if parent is not None:
            par = parent[:len(active)]
            depth, j = 0, t
            while j > 0 and int(par[i, j]) >= 0:
                depth, j = depth + 1, int(par[i, j])
        pos = contexts[i].shape[0] - 1 + depth
        return self._nonfinite(logits[i, t], active[i], pos, f"verify window token {t} of {logits.shape[1]}")

    @staticmethod
    def _done(toks: list[int], max_new: int, eos_set: set) -> bool:
        return len(toks) >= max_new or (bool(toks) and toks[-1] in eos_set)

    @staticmethod
    def _taken(toks: list[int], new: list[int], max_new: int, eos_set: set) -> int:
        """How many of `new` follow `toks` in the output: up to an eos id (included) or max_new_tokens."""
        if SpecEngine._done(toks, max_new, eos_set):
            return 0
        k = 0
        for x in new[:max_new - len(toks)]:  # no copy of the history per token: the rounds' hot path
            k += 1
            if x in eos_set:
                break
        return k

    def _cut_at_returned(self, res, host, outs: list[list[int]], run: "_Run") -> None:
        """Where EOS or max_new_tokens ends a row inside its accepted drafts, the round keeps only the tokens returned
        (the anchor and the drafts emitted): the committed state, and the prefix cache's end entry, are then at the
        returned tokens, which the caller's next turn starts with. The record is cut in place (a captured commit
        reads its buffers), by scalar writes on such a round only (no copy from the host)."""
        caps = [min(n + 1, 1 + self._taken(o, toks, run.max_new, run.eos))
                for o, toks, n in zip(outs, host.tokens, host.num_accepted)]
        cut = {i: c for i, (c, n) in enumerate(zip(caps, host.num_accepted)) if c < n + 1}
        if not cut:
            return
        res.acceptance.cut_(cut)
        for i, c in cut.items():
            host.num_accepted[i] = c - 1
            host.tokens[i] = host.tokens[i][:c - 1]

    def _emit(self, toks: list[int], new: list[int], run: "_Run") -> bool:
        """Append `new`, cut at EOS / max_new_tokens; -> finished."""
        kept = new[:self._taken(toks, new, run.max_new, run.eos)]
        toks.extend(kept)
        if run.streamer is not None and kept:
            run.streamer.put(torch.tensor(kept))
        return self._done(toks, run.max_new, run.eos)


def wrap(model, config: SpecConfig | None = None, **options) -> SpecEngine:
    """Speculative decoding for a transformers causal LM: `wrap(model).generate(input_ids)`.

    Engine options (`SpecConfig`, or its fields as keywords): drafter ("ngram", "model", "native", a trained drafter
    directory, a Drafter, or None: plain decoding through the same runner), num_draft_tokens (gamma, 7), strategy
    ("replay" or "snapshot"), commit ("eager" or "lazy"), draft_model, max_batch_size (8), max_length,
    static_shapes, cuda_graph, draft_tokens_by_batch (fewer drafts at larger batches, e.g. `{8: 3}`), cpu_linear
    ("auto", "onednn" or "aten"). Any other keyword is an option of the drafter (e.g. `max_ngram=2` for "ngram",
    `topk=4` for "eagle"; `untrained=True` with "mtp", "eagle" or "dspark": an untrained net of that kind).
    """
    return SpecEngine(model, config, **options)
