"""transformers' pure-torch paths for the hybrid families (fla's Triton kernels do not run on CPU)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5")  # the families the shared test matrix runs
MORE_FAMILIES = ("qwen3_5_moe", "olmo_hybrid", "bailing_hybrid")  # tests/test_adapters_more.py
ALL_FAMILIES = FAMILIES + MORE_FAMILIES  # every hybrid modeling module (transformers.models.<family>)
# the module-level chunked delta rule of each family, and the L2 norm its model applies to q and k
CHUNK_FNS = {"kimi_linear": ("chunk_kimi_delta_attention", "sqrt_div"),
             "qwen3_next": ("torch_chunk_gated_delta_rule", "rsqrt"),
             "qwen3_5": ("torch_chunk_gated_delta_rule", "rsqrt"),
             "qwen3_5_moe": ("torch_chunk_gated_delta_rule", "rsqrt"),
             "olmo_hybrid": ("torch_chunk_gated_delta_rule", "rsqrt"),
             "bailing_hybrid": ("chunk_kimi_delta_attention", "sqrt_div")}


def _chunk_adapter(norm: str, default_chunk: int, torch_chunk):
    """transformers' chunk signature (q, k `[B, T, Hk, K]`, v `[B, T, H, V]`, g, beta `[B, T, H]`) on
    `chunk_delta_rule`. `chunk_delta_rule` always L2-normalizes q and k (as every family's model asks); a call
    without `use_qk_l2norm_in_kernel` goes to transformers' own pure-torch `torch_chunk`."""
    from specdec.kernels import chunk_delta_rule

    def fn(query, key, value, g, beta, chunk_size=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, **kwargs):
        if not use_qk_l2norm_in_kernel:
            return torch_chunk(query, key, value, g, beta, chunk_size=chunk_size or 64, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=False, **kwargs)
        if query.shape[2] != value.shape[2]:  # grouped value heads: each q/k head serves a group of value heads
            rep = value.shape[2] // query.shape[2]
            query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
        o, S = chunk_delta_rule(query, key, value, g, beta, initial_state=initial_state, norm=norm,
                                chunk_size=chunk_size or default_chunk)
        return o, (S if output_final_state else None)
    return fn


def torch_original(fn):
    """The pure-torch function behind one of transformers' dispatching names (e.g. a modeling module's
    `recurrent_kimi_delta_attention`), or None when `fn` is not one. transformers wraps the torch function in a
    dispatcher to fla or the hub (`functools.wraps`: the original is its `__wrapped__`); with the `kernels` package
    installed (a dependency of transformers from 5.25) that dispatcher is in turn called by the `forward` of a
    `kernels` function module, the object the name then holds."""
    orig = getattr(fn, "__wrapped__", None)
    forward = getattr(type(fn), "forward", None)
    if orig is None and getattr(forward, "__closure__", None):
        inner = dict(zip(forward.__code__.co_freevars, forward.__closure__)).get("func")
        orig = getattr(inner.cell_contents, "__wrapped__", None) if inner is not None else None
    return orig if callable(orig) else None


CACHE_ARGS = ("cache", "past_key_values", "cache_params")  # the names of the cache keyword, newest first


def cache_arg(fn) -> str:
    """The keyword under which a transformers model or layer (its `forward`), or any callable, takes its cache: the
    first of CACHE_ARGS that its signature names, else `past_key_values`. transformers now says `cache`; through
    5.17 at least it said `past_key_values`, and `cache_params` for the Mamba models (which build their own cache
    when given none, and return it as `cache_params`). A cache passed under another name lands in `**kwargs`,
    unread: the layer attends over the new tokens only."""
    params = inspect.signature(getattr(fn, "forward", fn)).parameters
    return next((a for a in CACHE_ARGS if a in params), "past_key_values")


def rotary_tables(rotary, x, positions):
    """A transformers rotary module's `(cos, sin)` for `x` at `positions [B, T]`, given as the module takes them:
    `[3, B, T]` (one row per grid axis, all three the text positions) to a multimodal rotary (`mrope_section`:
    Qwen3.5's), which through 5.17 at least reads `[3, B, T]` only; `[B, T]` to every other."""
    if getattr(rotary, "mrope_section", None) is not None:
        positions = positions.expand(3, *positions.shape)
    return rotary(x, positions)


def installed_families() -> tuple[str, ...]:
    """The families of ALL_FAMILIES that the installed transformers has (5.17 has no bailing_hybrid)."""
    return tuple(f for f in ALL_FAMILIES if importlib.util.find_spec(f"transformers.models.{f}") is not None)


@contextlib.contextmanager
def torch_fallbacks(*families: str, chunked: bool = False, chunk_size: int = 16):
    """Route transformers' linear-attention layers to pure-torch code: swap each hub/fla-backed function of the
    modeling module for its pure-torch original (`torch_original`), restored on exit (also when a swap fails). Needed
    to run the transformers model's own forward (training, reference outputs) on CPU when fla is installed.

    families: default, those of ALL_FAMILIES that the installed transformers has (`installed_families`); a named
    family it lacks raises ModuleNotFoundError.

    chunked: also replace the family's chunked delta rule (prefill / training) with `kernels.chunk_delta_rule`,
    the same recurrence vectorized across chunks, so a CPU prefill or training step does not walk the tokens one by
    one, forward and backward.
    """
    swaps = []
    try:
        for fam in families or installed_families():
            mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
            for name, fn in list(vars(mod).items()):
                orig = torch_original(fn)
                if orig is not None and getattr(orig, "__module__", None) == mod.__name__:
                    swaps.append((mod, name, fn))
                    setattr(mod, name, orig)
            if chunked:
                name, norm = CHUNK_FNS[fam]
                swaps.append((mod, name, getattr(mod, name)))
                setattr(mod, name, _chunk_adapter(norm, chunk_size, getattr(mod, name)))
        yield
    finally:
        for mod, name, fn in reversed(swaps):
            setattr(mod, name, fn)


def transformers_generate(model, input_ids, *, max_new_tokens: int, eos_token_id=None, pad_token_id=None,
                          do_sample: bool = False, temperature: float = 1.0, seed: int | None = None,
                          attention_mask=None, **generate_kwargs):
    """transformers' own `model.generate` on `input_ids [B, n]`, as a user runs it without specdec: the
    plain-decode reference of the benchmarks. Under inference mode; on a CPU a hybrid family's fla kernels (Triton,
    GPU only) give way to transformers' own pure-torch code and its prefill's chunked delta rule to
    `kernels.chunk_delta_rule` (`torch_fallbacks(chunked=True)`: the faster torch prefill, so the reference is not
    held back). `seed` seeds torch's global generator when sampling; `attention_mask` (default all ones: one
    unpadded row or rows of one length) and any other keyword go to `generate`. -> sequences `[B, n + new]`."""
    import torch

    kw = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs,
              attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask)
    for key, val in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if val is not None:
            kw[key] = val
    if do_sample:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)  # plain temperature sampling, as specdec's default
        if seed is not None:
            torch.manual_seed(seed)
    family = (type(model).__module__.split(".")[-2:] or [None])[0]  # transformers.models.<family>.modeling_<family>
    on_cpu = next(model.parameters()).device.type == "cpu"
    ctx = torch_fallbacks(family, chunked=True) if on_cpu and family in ALL_FAMILIES else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        return model.generate(input_ids, **kw)
