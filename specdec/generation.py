"""transformers' `generate` conventions for `SpecEngine.generate`: which prompts a call holds and how it decodes them.

- Prompts (`read_prompts`): `input_ids` as a `[B, P]` tensor with its `attention_mask` (left or right padding: the
  pads are not prompt tokens), a `BatchEncoding` or its dict passed whole, a 2-D tensor, a list of 1-D sequences of
  any lengths, or one list of ints (one prompt). Without a mask, a block whose rows hold the pad id has its mask
  inferred as transformers infers it (`GenerationMixin._prepare_attention_mask_for_generation`), with its warnings
  where it cannot be.
- Settings (`resolve_settings`): `generation_config=` and the call's keywords over the model's own
  `generation_config` over transformers' global defaults, merged and validated as `GenerationMixin.generate` does
  (`_prepare_generation_config`): the same precedence and the same warnings (e.g. `temperature` without
  `do_sample`). specdec honours do_sample, temperature, top_k, top_p, max_new_tokens, max_length, eos_token_id and
  pad_token_id; a flag that would change the tokens and that specdec does not implement (beams, repetition penalty,
  min_new_tokens, ...) is refused when the call sets it and warned about when the model's config does.
"""

from __future__ import annotations

import copy
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specdec.verify import SamplingParams
from specdec.verify.accept import is_int_tensor

DEFAULT_MAX_NEW_TOKENS = 64  # when neither the call nor a generation config sets a length

# the flags specdec decodes by (besides these, `seed` and `streamer` are specdec's own keywords)
HONOURED = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "max_length", "eos_token_id",
            "pad_token_id")

# flags that change which tokens come out (or what is returned), with the value that leaves them off; specdec does not
# implement them: the call setting one is refused, a model config setting one is warned about
UNSUPPORTED = {
    "num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": 0, "min_p": None,
    "top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
    "exponential_decay_length_penalty": None, "guidance_scale": None, "watermarking_config": None,
    "stop_strings": None, "max_time": None, "penalty_alpha": None, "dola_layers": None, "constraints": None,
    "force_words_ids": None, "output_scores": False, "output_logits": False, "output_attentions": False,
    "output_hidden_states": False,
}

# keys a tokenizer's output may carry besides input_ids and attention_mask (all zeros for a causal LM)
TOKENIZER_EXTRAS = ("token_type_ids",)


@dataclass
class Prompts:
    """A call's prompts: `rows` the prompt tokens of each request (`[P_b]` long, pads removed) and `block`, the
    `[B, P]` block the caller passed (pads included; None for a list of sequences of different lengths): the output's
    `sequences` start with it, as transformers' do."""

    rows: list[torch.Tensor]
    block: torch.Tensor | None


@dataclass
class Settings:
    """How a call decodes: `sampling`, `max_new_tokens` per request, the stop ids `eos` and the output's pad id."""

    sampling: SamplingParams
    max_new_tokens: int
    eos: set[int]
    pad_token_id: int


def _logger():
    from transformers.utils import logging
    return logging.get_logger("transformers.generation.utils")  # transformers' generate warns from there


def _as_ids(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{what}: expected token ids (a tensor or a list of ints), got {type(x).__name__}: {e}") \
            from None


def _one_prompt(x) -> bool:
    """A list or tuple of ints (not of sequences): one prompt."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in x)


def read_prompts(input_ids, attention_mask=None, *, extras: Mapping | None = None,
                 pad_token_id: int | None = None, eos: set[int] = frozenset()) -> Prompts:
    """The caller's prompts (checks of shapes, masks and dtypes; token ids against the vocabulary are the engine's).

    input_ids: `[B, P]` or `[P]` tensor, a list of 1-D sequences, one list of ints, or a `BatchEncoding` / dict with
    `input_ids` (and `attention_mask`). attention_mask: `[B, P]` of 0 / 1, each row's ones one run (left or right
    padding). `extras`: other keys of a tokenizer's output (`token_type_ids`, all zeros). `pad_token_id` / `eos`: the
    generation config's (not yet defaulted to eos), for transformers' mask inference."""
    if isinstance(input_ids, Mapping):
        enc = dict(input_ids)
        if "input_ids" not in enc:
            raise ValueError(f"input_ids: a mapping without 'input_ids' (keys: {sorted(enc)})")
        if attention_mask is not None and enc.get("attention_mask") is not None:
            raise ValueError("attention_mask: given both in input_ids (a tokenizer's output) and as a keyword")
        input_ids, attention_mask = enc.pop("input_ids"), enc.pop("attention_mask", attention_mask)
        extras = {**enc, **(extras or {})}
    for key, value in (extras or {}).items():
        if key not in TOKENIZER_EXTRAS:
            raise ValueError(f"{key}: not an option of generate (model inputs other than input_ids and "
                             f"attention_mask are not supported)")
        if value is not None and bool((_as_ids(value, key) != 0).any()):
            raise ValueError(f"{key}: expected all zeros (a causal LM's), got other values")
    if input_ids is None:
        raise ValueError("input_ids: no prompts")
    if _one_prompt(input_ids):
        input_ids = [list(input_ids)]
    if attention_mask is not None and not isinstance(input_ids, torch.Tensor):
        input_ids = _as_ids(input_ids, "input_ids")  # a padded batch as lists: one block
    if isinstance(input_ids, torch.Tensor) or hasattr(input_ids, "__array__"):
        block = _as_ids(input_ids, "input_ids")
        if block.dim() == 1:
            block = block[None]
        if block.dim() != 2:
            raise ValueError(f"input_ids: expected [B, P] or a list of 1-D sequences, got {list(block.shape)}")
        if block.shape[0] == 0:
            raise ValueError("input_ids: no prompts")
        if not is_int_tensor(block):  # a cast would truncate silently
            raise ValueError(f"input_ids: expected integer token ids, got {block.dtype}")
        mask = _mask(block, attention_mask, pad_token_id, eos)
        rows = []
        for i, row in enumerate(mask):
            if not _one_run(row):
                raise ValueError(f"input_ids: prompt {i} is empty (its attention_mask has no 1)" if not bool(row.any())
                                 else f"attention_mask: row {i} has a 0 between its 1s; expected left or right "
                                      f"padding (one run of prompt tokens)")
            on = row.nonzero().flatten()
            rows.append(block[i, int(on[0]):int(on[-1]) + 1])
        return Prompts(rows, block)
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise ValueError("input_ids: no prompts" if isinstance(input_ids, (list, tuple)) else
                         f"input_ids: expected a tensor, a list of sequences or a tokenizer's output, got "
                         f"{type(input_ids).__name__}")
    rows = [_as_ids(p, f"input_ids: prompt {i}") for i, p in enumerate(input_ids)]
    for i, p in enumerate(rows):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"input_ids: prompt {i} is empty or not 1-D (shape {list(p.shape)})")
        if not is_int_tensor(p):
            raise ValueError(f"input_ids: prompt {i}: expected integer token ids, got {p.dtype}")
    return Prompts(rows, None)


def _mask(block: torch.Tensor, attention_mask, pad_token_id, eos: set[int]) -> torch.Tensor:
    """The `[B, P]` bool mask of `block`: the caller's, else inferred from the pad id as transformers infers it."""
    if attention_mask is not None:
        mask = _as_ids(attention_mask, "attention_mask")
        if mask.dim() == 1:
            mask = mask[None]
        if tuple(mask.shape) != tuple(block.shape):
            raise ValueError(f"attention_mask: expected the shape of input_ids {list(block.shape)}, got "
                             f"{list(mask.shape)}")
        if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()
                                         or bool(((mask != 0) & (mask != 1)).any())):
            raise ValueError("attention_mask: expected 0 / 1 (or bool) values")
        return mask.to(torch.bool).cpu()
    batched = block.shape[0] > 1
    if pad_token_id is None and not eos:
        return torch.ones(block.shape, dtype=torch.bool)
    if pad_token_id is None and batched:  # transformers then pads with an eos id, and cannot infer the mask
        _logger().warning(
            "The attention mask and the pad token id were not set, with a batched input. As a consequence, you may "
            "observe unexpected behavior. Please pass your input's `attention_mask` to obtain reliable results.")
    if pad_token_id is None or pad_token_id in eos:
        if batched:
            _logger().warning_once(
                "The attention mask is not set with a batched input, and cannot be inferred from input because pad "
                "token is same as eos token. As a consequence, you may observe unexpected behavior. Please pass your "
                "input's `attention_mask` to obtain reliable results.")
        return torch.ones(block.shape, dtype=torch.bool)
    mask = (block != pad_token_id).cpu()
    inside = [i for i, row in enumerate(mask) if not _one_run(row)]
    if inside:  # the pad id is a token inside a prompt: pads cannot be told apart from tokens
        warnings.warn(f"input_ids: pad_token_id {pad_token_id} occurs inside prompt row {inside[0]}, so the padding "
                      f"cannot be inferred; every token of input_ids is taken as a prompt token (pass attention_mask "
                      f"for a padded batch)", UserWarning, stacklevel=6)
        return torch.ones(block.shape, dtype=torch.bool)
    return mask


def _one_run(row: torch.Tensor) -> bool:
    """The ones of `row [P]` (bool) are one run, not empty."""
    on = row.nonzero().flatten()
    return on.numel() > 0 and int(on[-1]) - int(on[0]) + 1 == on.numel()


def _is_set(value, neutral) -> bool:
    return value is not None and not (isinstance(value, (bool, int, float)) and value == neutral) \
        and not (neutral is None and value in ([], ()))


def merged_config(model_config, generation_config, kwargs: dict):
    """A `GenerationConfig` as `GenerationMixin._prepare_generation_config` builds it: `generation_config` (or a fresh
    one), then the model's config for what is unset, then transformers' global defaults, then the call's keywords
    (`update`, which validates: transformers' warnings, e.g. a sampling flag without do_sample)."""
    from transformers import GenerationConfig
    cfg = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    if model_config is not None:
        cfg.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    cfg.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    cfg.update(**kwargs)
    return cfg


def _length(sources, *, base: int, room: int) -> int:
    """New tokens per request: the first source, in precedence order, that sets `max_new_tokens` or `max_length`
    (transformers' total: prompt block + new). `sources`: (max_new_tokens, max_length, capped) per source; a capped
    source (the model's own config, or no source: `DEFAULT_MAX_NEW_TOKENS`) is cut to `room`, what the engine's
    `max_length` leaves after the longest prompt."""
    for new, total, capped in sources:
        if new is None and total is None:
            continue
        if new is None:
            if total <= base:
                raise ValueError(f"max_length: {total} leaves no room for new tokens after a prompt of {base}; set "
                                 f"max_new_tokens")
            new = total - base
        return max(1, min(new, room)) if capped else new
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, room))


def resolve_settings(cfg, model_config, generation_config, kwargs: dict, *, eos: set[int], prompts: Prompts,
                     max_length: int, fallback_pad: int) -> Settings:
    """How a call decodes `prompts`. `cfg`: the merged config (`merged_config`) of the model's `model_config`, the
    call's `generation_config` and generation keywords `kwargs`; `eos`: its stop ids (`eos_ids`); `max_length`: the
    engine's cap on prompt + new tokens (a length from the model's config or the default is cut to it; one the caller
    set is checked by the engine); `fallback_pad`: the pad id when no config names one nor an eos. transformers'
    `max_length` counts from the prompt block (`P`; for a list of prompts of different lengths, from the longest)."""
    longest = max(p.numel() for p in prompts.rows)
    base = longest if prompts.block is None else prompts.block.shape[1]
    own = [(c.max_new_tokens, c.max_length, False) for c in (generation_config,) if c is not None]
    model = [(c.max_new_tokens, c.max_length, True) for c in (model_config,) if c is not None]
    call = [(kwargs.get("max_new_tokens"), None, False), (None, kwargs.get("max_length"), False)]
    new = _length(call + own + model, base=base, room=max_length - longest)
    pad = cfg.pad_token_id
    if pad is None:  # transformers pads with the first eos id
        pad = next(iter(_eos_list(cfg.eos_token_id)), fallback_pad)
    sampling = SamplingParams(do_sample=bool(cfg.do_sample), temperature=cfg.temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p)
    return Settings(sampling, int(new), eos, int(pad))


def check_call(generation_config, kwargs: dict) -> None:
    """The call's generation keywords and `generation_config`, before anything is merged: an unknown keyword, a flag
    specdec does not implement, or a length that is not an int >= 1 is one ValueError naming it."""
    from transformers import GenerationConfig
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config: expected a transformers GenerationConfig or None, got "
                         f"{type(generation_config).__name__}")
    known = set(GenerationConfig().to_dict()) | set(UNSUPPORTED) | set(HONOURED)
    for key, value in kwargs.items():
        if key not in known:
            raise ValueError(f"{key}: not an option of generate (generation options: {', '.join(HONOURED)}, seed, "
                             f"streamer, generation_config, attention_mask)")
        if key in UNSUPPORTED and _is_set(value, UNSUPPORTED[key]):
            raise ValueError(f"{key}: not supported by specdec's generate (it decodes by {', '.join(HONOURED)})")
    for key in ("max_new_tokens", "max_length"):
        v = kwargs.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{key}: expected an int >= 1, got {v!r}")
    if generation_config is not None:
        for key, neutral in UNSUPPORTED.items():
            if _is_set(getattr(generation_config, key, None), neutral):
                raise ValueError(f"generation_config: {key} is not supported by specdec's generate (it decodes by "
                                 f"{', '.join(HONOURED)})")


def warn_ignored(cfg) -> None:
    """Flags of the merged config that specdec does not implement: only the model's own config can have set them
    (`check_call` refused the call's), so they are warned about, as transformers warns about flags it ignores."""
    ignored = [k for k, neutral in UNSUPPORTED.items() if _is_set(getattr(cfg, k, None), neutral)]
    if ignored:
        warnings.warn(f"the model's generation_config sets {', '.join(ignored)}, which specdec's generate does not "
                      f"implement; decoding without", UserWarning, stacklevel=5)


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return eos.flatten().tolist()
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def eos_ids(eos) -> set[int]:
    """The stop tokens of `eos_token_id`: None (never stop early), an int, a list / tuple of ints or an integer tensor
    of any shape; anything else is one ValueError (a string or a tensor in a set of ints would never match, and
    generation would run on silently)."""
    if isinstance(eos, torch.Tensor) and not is_int_tensor(eos):
        raise ValueError(f"eos_token_id: expected integer token ids, got a {eos.dtype} tensor")
    items = _eos_list(eos)
    bad = [x for x in items if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
    if bad:
        raise ValueError(f"eos_token_id: expected None, an int, a list of ints or an integer tensor, got {eos!r}")
    return {int(x) for x in items}
