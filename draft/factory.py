"""Build the drafter an engine asked for: by name, from a trained drafter directory, or as given."""

from __future__ import annotations

import os
from collections.abc import Callable

from .base import Drafter
from .registry import KINDS, build_drafter_net, kind_module, load_drafter
from .model import ModelDrafter
from .ngram import NgramDrafter


def make_drafter(drafter, target_model, *, gamma: int, max_batch_size: int, max_length: int, draft_model=None,
                 runner_factory: Callable | None = None, **drafter_kwargs) -> Drafter:
    """-> the drafter for `target_model`.

    `drafter`: a `Drafter` (returned as is), 'ngram', 'model' (needs `draft_model`, same vocabulary, and
    `runner_factory`), 'native' (the MTP layers in the target's checkpoint; option `native_path`), a trained kind
    ('mtp', 'eagle', 'dspark': an untrained net sized for the target; 'eagle' with `draft_model=DIR`: an EAGLE-3
    checkpoint in the SpecForge / SGLang format), a trained drafter directory or an EAGLE-3 directory. `gamma`:
    drafts per round; `max_batch_size`, `max_length`: the engine's limits.
    `runner_factory`: a callable with `specdec.runner.make_runner`'s signature, for drafters that run a model
    of their own. `drafter_kwargs`: the drafter's own options.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if drafter == "ngram":
        return NgramDrafter(**drafter_kwargs)
    if drafter == "model":
        if draft_model is None:
            raise ValueError("draft_model: required with drafter='model'")
        tv = target_model.config.get_text_config().vocab_size
        dv = draft_model.config.get_text_config().vocab_size
        if tv != dv:
            raise ValueError(f"draft_model: vocab size {dv} does not match the target's {tv}")
        return ModelDrafter(draft_model, runner_factory=runner_factory, max_batch_size=max_batch_size,
                            max_length=max_length, gamma=gamma, **drafter_kwargs)
    if drafter == "native":  # the checkpoint's own MTP layers
        from . import native
        net = native.build(target_model, native_path=drafter_kwargs.pop("native_path", None))
        return native.make_drafter(net, gamma=gamma, max_batch_size=max_batch_size, **drafter_kwargs)
    if drafter == "eagle" and draft_model is not None:  # a published EAGLE-3 checkpoint (SpecForge / SGLang)
        from . import eagle3_format
        return eagle3_format.make_drafter(draft_model, target_model, gamma=gamma, max_batch_size=max_batch_size,
                                          **drafter_kwargs)
    if isinstance(drafter, (str, os.PathLike)) and os.path.isdir(drafter):
        from . import eagle3_format
        if eagle3_format.is_eagle3_dir(drafter):
            return eagle3_format.make_drafter(drafter, target_model, gamma=gamma, max_batch_size=max_batch_size,
                                              **drafter_kwargs)
    if isinstance(drafter, str) and drafter in KINDS:  # untrained net of that kind, sized for the target
        net = build_drafter_net(drafter, target_model)
        return kind_module(drafter).make_drafter(net, gamma=gamma, max_batch_size=max_batch_size, **drafter_kwargs)
    if isinstance(drafter, (str, os.PathLike)) and os.path.isdir(drafter):
        net = load_drafter(os.fspath(drafter), target_model)
        return kind_module(net.config.kind).make_drafter(net, gamma=gamma, max_batch_size=max_batch_size,
                                                         **drafter_kwargs)
    raise ValueError(f"drafter: expected 'ngram', 'model', 'native', one of {sorted(KINDS)}, a trained drafter "
                     f"directory or a Drafter instance, got {drafter!r}")
