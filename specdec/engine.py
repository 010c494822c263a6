"""`specdec.wrap(model)`: speculative generation with a target runner, a drafter and acceptance rules."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.draft import DraftBlock
from specdec.draft.base import Contexts, Observation, check_block
from specdec.tensors import outside_inference
from specdec.verify import sample_token

from . import cpu_linear, generation
from .config import SpecConfig
from .loop import RequestLoop, _Lanes
from .requests import Request
from .round import drafter_failed
from .runner import index_tensor
from .stats import SpecStats


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


class SpecEngine(RequestLoop):
    """Lossless speculative decoding for one target model (see `specdec.wrap`). Requests come from `submit` (online:
    tokens as they are committed, `Request.cancel`) or `generate` (transformers' call, submit + step until done);
    here are their admission, rounds and retirement; the queue, lanes and steps are `RequestLoop`'s
    (`specdec/loop.py`); what an engine is built from (checks, drafter, target runner, memory plan, round step) is
    `EngineParts`'s."""

    # ---- requests in -----------------------------------------------------------------------------------------
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

        Any number of prompts: they join the engine's queue in order (`submit`), at most `max_batch_size` run at
        once (the lanes), the rest wait and take a lane as soon as one is free (continuous batching: a finished
        request's lane is refilled before the next round). The call steps the request loop until its requests end
        (with `start`, the background loop does). A request that fails raises its error here, and the call's other
        requests are withdrawn. Output rows follow the input order.

        Runs under `torch.inference_mode` (no autograd bookkeeping per op); what the engine keeps across calls stays
        normal tensors, so its runner and drafter can be driven outside it, and `sequences` is a normal tensor. Runs
        inside `cpu_linear.engaged()`: the oneDNN copies of a CPU model's weights are checked against the weights at
        their first use in each call, so weights updated between calls (however: an optimizer step, a write through
        `.data`) are the ones used."""
        t0 = time.perf_counter()
        given, settings, reqs = self._requests(input_ids, attention_mask, generation_config, seed, streamer, kwargs)
        stats = reqs[0].stats
        try:
            self._enqueue(reqs)
            self._drive(reqs)
        finally:
            try:
                self._withdraw(reqs)
            finally:
                if streamer is not None:
                    streamer.end()
        stats.timings["total"] = time.perf_counter() - t0
        pad = settings.pad_token_id
        out_tokens = [r.out for r in reqs]
        counts = [len(o) for o in out_tokens]
        with outside_inference():  # the caller's tensor: a normal one, as transformers' generate returns
            if given.block is not None:  # the prompt block as given, then the new tokens (transformers' layout)
                new = torch.tensor([o + [pad] * (max(counts) - len(o)) for o in out_tokens], dtype=torch.long)
                seqs = torch.cat([given.block.detach().cpu().long(), new], 1)
            else:  # prompts of different lengths: each followed by its new tokens, right-padded
                rows_out = [r.hist[:r.prompt.numel()] + r.out for r in reqs]
                width = max(len(r) for r in rows_out)
                seqs = torch.tensor([r + [pad] * (width - len(r)) for r in rows_out], dtype=torch.long)
        return GenerateOutput(seqs, stats, counts, [r.finish_reason for r in reqs])

    @torch.inference_mode()
    def submit(self, prompt, generation_config=None, *, seed: int | None = None, stats: SpecStats | None = None,
               **kwargs) -> Request:
        """Queue one prompt (a `[P]` tensor or a list of ints) and return its `Request` at once: its tokens arrive as
        they are committed (iterate it, `async for` it, or `result()`), `cancel()` ends it at the next round
        boundary. The keywords are `generate`'s (its config merged the same way); `seed` gives it a sampling stream
        of its own (requests without one share the engine's); `stats`: the counters it records into (a server's,
        shared by its requests; default its own). The request runs when the loop steps: `step()`, or the
        background loop of `start()`."""
        served = self.tp is not None and self.tp.leads and self._thread is not None
        if self.tp is not None and not served:
            raise ValueError("submit: with tp_group, on rank 0 while its loop serves (`start`, with `follow` on the "
                             "other ranks): every rank must run the same requests in the same rounds")
        if generation_config is not None and self.tp is not None:
            raise ValueError("generation_config: not with tp_group (the keywords travel to the other ranks)")
        _, _, reqs = self._requests(prompt, None, generation_config, seed, None, dict(kwargs), one=True, agree=False)
        if served and seed is None and reqs[0].sampling.do_sample:  # drawn here, sent with the request
            seed = int(torch.randint(0, 2 ** 62, (1,)))
            _, _, reqs = self._requests(prompt, None, None, seed, None, dict(kwargs), one=True, agree=False)
        spec = (list(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt), dict(kwargs), seed)
        r = reqs[0]
        r.spec = spec
        if stats is not None:
            r.stats = stats
        if served:  # to every rank at the loop's next step
            with self._queue_lock:
                self._inbox.append(r)
                self._queue_lock.notify_all()
        else:
            self._enqueue(reqs)
        return r

    def _requests(self, input_ids, attention_mask, generation_config, seed, streamer, kwargs: dict, *,
                  one: bool = False, agree: bool = True) -> tuple[generation.Prompts, generation.Settings,
                                                                  list[Request]]:
        """A call's prompts and settings read and checked (`specdec.generation`), as requests sharing one counter
        set and one sampling stream (`seed`); `one`: exactly one prompt; `agree`: under tensor parallelism, the
        ranks agree on a seed here (a collective: `generate` on every rank), else the caller gives it."""
        extras = {k: kwargs.pop(k) for k in generation.TOKENIZER_EXTRAS if k in kwargs}
        generation.check_call(generation_config, kwargs)
        own = getattr(self.model, "generation_config", None)
        merged = generation.merged_config(own, generation_config, kwargs)
        generation.warn_ignored(merged)
        eos = generation.eos_ids(merged.eos_token_id)
        given, prompts, host_prompts = self._prompts(input_ids, attention_mask, extras=extras,
                                                     pad_token_id=merged.pad_token_id, eos=eos)
        if one and len(prompts) != 1:
            raise ValueError(f"prompt: expected one prompt (a 1-D tensor or a list of ints), got {len(prompts)}")
        settings = generation.resolve_settings(merged, own, generation_config, kwargs, eos=eos, prompts=given,
                                               max_length=self.max_length, fallback_pad=self.pad_token_id)
        sampling, max_new_tokens = settings.sampling, settings.max_new_tokens
        longest = max(p.numel() for p in prompts)
        if longest + max_new_tokens > self.max_length:
            raise ValueError(f"max_new_tokens: prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_length {self.max_length}")
        if streamer is not None and len(prompts) != 1:
            raise ValueError("streamer: streaming supports a single prompt")
        if getattr(self._stepping, "on", False):
            raise RuntimeError("generate: called from inside a step of this engine (a streamer or drafter calling "
                               "back): the request loop runs one step at a time")
        if self.tp is not None and agree and self._thread is not None:
            raise RuntimeError("generate: not while this rank's loop serves (tensor parallel: submit on rank 0)")
        gen = None
        if self.tp is not None and sampling.do_sample and agree:  # one sampling stream on every rank
            seed = self.tp.agree_seed(seed)
        if seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        # the drafter draws from a stream of its own (under tp only rank 0 drafts), the acceptance from `gen` on every
        # rank alike: one seed, one output, at every tp size
        draft_gen = None if gen is None else torch.Generator(device=self.runner.device).manual_seed(seed + 1)
        stats = SpecStats()
        verify = self.target.num_verify_tokens
        reqs = []
        for i, (p, h) in enumerate(zip(prompts, host_prompts)):
            self._uids += 1
            reqs.append(Request(p, list(h), max_new_tokens, settings.eos, sampling, gen, draft_gen, stats, streamer,
                                index=i, worst=p.numel() + max_new_tokens + verify, uid=self._uids))
        return given, settings, reqs

    # ---- admission and retirement ------------------------------------------------------------------------------
    def _admit(self, lanes: "_Lanes", ids: list[int], reqs: list[Request]) -> list[int]:
        """Start requests `reqs` in the free lanes `ids`: take slots, prefill the prompts together, draw each
        request's first token (one readback), tell the drafter; -> the lanes whose request goes on."""
        slots = self.runner.alloc(len(ids))
        for l, r, s in zip(ids, reqs, slots):
            lanes.slot[l], lanes.req[l] = s, r
            r.status = "running"
        ps = [r.prompt for r in reqs]
        sizes = [p.numel() for p in ps]
        # each request's KV pages for its worst case, reserved before its prefill (after the shared pages of its
        # cached prefix): no round of it takes pages (CUDA graphs replay none)
        worst = [r.worst for r in reqs]
        if self.prefix_cache is None:
            self.runner.reserve(slots, worst)
        self.drafter.begin(ids, ps)
        t = time.perf_counter()
        capture = tuple(self.drafter.feature_layers)
        lens = torch.tensor(sizes, dtype=torch.long, device=lanes.tok.device)
        cached = self._cached
        if cached is not None:  # each prompt from its deepest cached prefix
            last, feats, hits = cached.start(slots, ps, [r.hist for r in reqs], worst, capture)
            if "hidden" not in feats:  # a drafter that observes no features: zeros, as no memory
                feats["hidden"] = last.new_zeros(()).expand(len(ids), max(sizes), self.runner.hidden_size)
            self.drafter.observe(Observation.rows_of(ids, sizes, lens, tokens=ps, hidden=feats["hidden"],
                                                     features={c: feats[c] for c in capture}))
        else:  # every prompt in one forward per chunk (the hybrid runner)
            out = self.runner.prefill_batch(slots, ps, capture=capture, last_logits=True)
            last = out.logits[:, 0]
            self.drafter.observe(Observation.rows_of(ids, sizes, lens, tokens=ps, hidden=out.hidden,
                                                     features={c: out.captured[c] for c in capture}))
        finite = torch.isfinite(last).all(1)  # checked after the one readback (a draw from NaN would raise first)
        safe = torch.where(finite[:, None], last, 0)
        first = torch.empty(len(ids), dtype=torch.long, device=last.device)
        by_key: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            by_key.setdefault(r.key, []).append(i)
        for rows in by_key.values():  # one draw per way of decoding (a generate call's requests: one)
            r = reqs[rows[0]]
            rows_t = self._index(rows)
            first[rows_t] = sample_token(safe[rows_t], r.sampling, r.gen)
        back = torch.cat([first[:, None], finite[:, None].long()], 1).tolist()
        for i, (_, ok) in enumerate(back):
            if not ok:
                raise self._nonfinite(last[i], reqs[i].index, ps[i].numel() - 1)
        spent = time.perf_counter() - t
        for st in {id(r.stats): r.stats for r in reqs}.values():
            st.timings["prefill"] += spent
        for r in reqs:
            r.stats.prompt_tokens += r.prompt.numel()
        if cached is not None:
            for r, n in zip(reqs, hits):
                r.stats.cached_tokens += n
        for r in reqs:
            if r.streamer is not None:
                r.streamer.put(r.prompt.cpu())
        lane_t = self._index(ids)
        row = torch.full((len(ids), lanes.tok.shape[1]), self.pad_token_id, dtype=torch.long, device=lens.device)
        row[:, :max(sizes)] = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True, padding_value=self.pad_token_id)
        row[torch.arange(len(ids), device=row.device), lens] = first
        lanes.tok[lane_t] = row
        lanes.lens[lane_t] = lens + 1
        lanes.anchors[lane_t] = first
        going = []
        for i, (l, r) in enumerate(zip(ids, reqs)):
            self._emit(r, [back[i][0]])
            if not self._done(r):
                going.append(l)
            r.hist.extend(r.out)
        if cached is not None:  # each prompt's end: an entry, written after the first tokens went out
            for l, P in zip(ids, sizes):
                cached.publish(lanes.req[l].hist[:P], lanes.slot[l])
        return going

    def _retire(self, ids: list[int], *, publish: bool = False, status: str | None = "finished") -> None:
        """Requests of lanes `ids` leave: with `publish` (they ended, or were cancelled) their state goes to the
        prefix cache; then the drafter and the runner let go of them, and each request that has not ended ends with
        `status` (None: the caller ends them)."""
        lanes = self._lanes
        reqs = [lanes.req[l] for l in ids]
        try:
            if publish and self._cached is not None:  # at the returned tokens: a round commits nothing past them
                for l in ids:
                    s = lanes.slot[l]
                    self._cached.publish(lanes.req[l].hist[:self.runner.length(s)], s)
            try:
                self.drafter.release(ids)
            finally:
                held = [lanes.slot[l] for l in ids if lanes.slot[l] is not None]
                try:
                    if held:
                        self.runner.release(held)
                finally:
                    for l in ids:
                        lanes.slot[l] = None
                        lanes.req[l] = None
        finally:
            for r in reqs:
                if r is not None and not r.done and status is not None:
                    r._end(status)

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

    def _round(self, active, lanes: "_Lanes"):
        """One speculative round of the `active` lanes, whose requests decode alike (`Request.key`): draft, verify,
        accept, one readback, commit, observe.

        Host state per lane: its request's `hist` (prompt + committed tokens, the anchor last) and `out`. Device state:
        the token buffer `tok [L, W]` with lengths `lens [L]`, and `anchors [L]`. The drafter's block is
        checked with one host read; everything the host needs of the round (accepted counts, new tokens,
        path, finiteness of the logits) comes back in one more; nothing else in here reads back.
        With static shapes the verify step sees `[Bk, T]` for the batch bucket Bk >= B (rows past B: the
        null slot, nothing drafted, nothing committed) and T fixed by gamma or the tree's node budget."""
        slots, tok, lens, anchors = lanes.slot, lanes.tok, lanes.lens, lanes.anchors
        reqs = [lanes.req[b] for b in active]
        lead = reqs[0]  # how the group decodes: its sampling rule and streams
        sampling = lead.sampling
        sinks = list({id(r.stats): r.stats for r in reqs}.values())  # the counters the group records into
        B = len(active)
        started = None if self.tp is None else self.tp.collectives
        idx = self._index(active)
        contexts = Contexts([tok[b, :len(r.hist)] for b, r in zip(active, reqs)], [r.hist for r in reqs])
        static = self.config.static_shapes
        gamma = self.config.gamma_for(self.round_step.bucket(B) if static else B)
        if not static:
            gamma = min(gamma, max(r.max_new - len(r.out) for r in reqs))
        # a drafter with a static draft step drafts inside the device step (with the verify, in one CUDA graph)
        static_draft = static and self.drafter.static_draft and self.tp is None
        t = time.perf_counter()
        if gamma == 0:  # plain decoding: nothing to draft, and no block to check (its check reads back)
            block = DraftBlock.empty(B, self.runner.device)
        else:
            leads = self.tp is None or self.tp.leads
            block = None if static_draft or not leads else \
                self._propose(active, contexts, gamma, lead)
            if self.tp is not None:  # rank 0's checked block on every rank
                block = self.tp.share_block(block, B, max(gamma, self.runner.num_verify_tokens - 1))
        spent = time.perf_counter() - t
        for st in sinks:
            st.timings["draft"] += spent
        t = time.perf_counter()
        host_slots = [slots[b] for b in active]
        step = self.round_step.inputs(host_slots, anchors[idx], block, sampling, gamma, rows=active)
        graphed = self.config.cuda_graph and not sampling.do_sample
        res = (self._graphs.step(step, sampling) if graphed
               else self.round_step.device_step(step, sampling, lead.gen, lead.stats))
        host = res.read(B)
        if not all(host.finite):
            raise self._nonfinite_round(res.logits[:B], active, contexts, res.parent)
        for st in sinks:
            rows = [i for i, r in enumerate(reqs) if r.stats is st]
            st.record(*([v[i] for i in rows] for v in (host.num_drafts, host.num_accepted, host.reached)))
        self._cut_at_returned(res, host, reqs)
        (self._graphs.commit_step if graphed else self.round_step.commit_step)(res, host)
        spent = time.perf_counter() - t
        for st in sinks:
            st.timings["verify"] += spent
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
        self.drafter.observe(Observation.rows_of(active, sizes, kept, tokens=kept_ids, hidden=kept_h, features=kept_f))
        for r, toks in zip(reqs, host.tokens):
            before = len(r.out)
            self._emit(r, toks)
            r.hist.extend(r.out[before:])
        if self._cached is not None:  # the track boundaries this round passed
            for b, r, n in zip(active, reqs, sizes):
                s = slots[b]
                after = self.runner.length(s)
                for t in self._cached.boundaries(after - n, after):
                    self._cached.publish(r.hist[:t], s, t)
        if started is not None:
            for st in sinks:
                st.collectives.append(self.tp.collectives - started)

    # ---- failures ----------------------------------------------------------------------------------
    def _propose(self, active, contexts, gamma, lead: Request) -> DraftBlock:
        """The drafter's block, checked; a drafter that raises (any Exception) or returns a malformed block
        costs speed, never correctness: plain decode this round (an empty block)."""
        B = len(active)
        try:
            block = self.drafter.propose(active, contexts, gamma, sampling=lead.sampling, generator=lead.draft_gen)
            runner = self.runner
            return check_block(block, B, gamma, device=runner.device, vocab=self._vocab,
                               tree_budget=runner.num_verify_tokens if runner.supports_tree else None,
                               target=type(runner).__name__)
        except Exception as e:
            what = f"{type(e).__name__}: {e}"
            try:  # drop whatever the drafter left half-done, so its next round starts from committed state
                self.drafter.abort(active)
            except Exception as e2:
                what += f"; its abort failed too ({type(e2).__name__}: {e2})"
            drafter_failed(self.drafter, what, lead.stats)
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
        pos = contexts.tensors[i].shape[0] - 1 + depth
        return self._nonfinite(logits[i, t], active[i], pos, f"verify window token {t} of {logits.shape[1]}")

    @staticmethod
    def _taken(r: Request, new: list[int]) -> int:
        """How many of `new` follow `r`'s output: up to an eos id (included) or max_new_tokens."""
        if RequestLoop._done(r):
            return 0
        k = 0
        for x in new[:r.max_new - len(r.out)]:  # no copy of the history per token: the rounds' hot path
            k += 1
            if x in r.eos:
                break
        return k

    def _cut_at_returned(self, res, host, reqs: list[Request]) -> None:
        """Where EOS or max_new_tokens ends a row inside its accepted drafts, the round keeps only the tokens returned
        (the anchor and the drafts emitted): the committed state, and the prefix cache's end entry, are then at the
        returned tokens, which the caller's next turn starts with. The record is cut in place (a captured commit
        reads its buffers), by scalar writes on such a round only (no copy from the host)."""
        caps = [min(n + 1, 1 + self._taken(r, toks)) for r, toks, n in zip(reqs, host.tokens, host.num_accepted)]
        cut = {i: c for i, (c, n) in enumerate(zip(caps, host.num_accepted)) if c < n + 1}
        if not cut:
            return
        res.acceptance.cut_(cut)
        for i, c in cut.items():
            host.num_accepted[i] = c - 1
            host.tokens[i] = host.tokens[i][:c - 1]

    def _emit(self, r: Request, new: list[int]) -> None:
        """Append `new` to `r`'s output, cut at EOS / max_new_tokens (its streams fed)."""
        kept = new[:self._taken(r, new)]
        if kept:
            r._emit(kept)


def wrap(model, config: SpecConfig | None = None, **options) -> SpecEngine:
    """Speculative decoding for a transformers causal LM: `wrap(model).generate(input_ids)`.

    Engine options (`SpecConfig`, or its fields as keywords): drafter ("ngram", "model", "native", a trained drafter
    directory, a Drafter, or None: plain decoding through the same runner), num_draft_tokens (gamma, 7), strategy
    ("replay" or "snapshot"), commit ("eager" or "lazy"), draft_model, max_batch_size (8), max_length,
    static_shapes, cuda_graph, draft_tokens_by_batch (fewer drafts at larger batches, e.g. `{8: 3}`), cpu_linear
    ("auto", "onednn" or "aten"), memory (a byte budget or a share of free memory), prefix_cache (True or a byte
    budget), track_interval, states_per_path, tp_group (a process group: tensor parallelism). Any other keyword is
    an option of the drafter (e.g. `max_ngram=2` for "ngram", `topk=4` for "eagle"; `untrained=True` with "mtp",
    "eagle" or "dspark": an untrained net of that kind).
    """
    return SpecEngine(model, config, **options)
