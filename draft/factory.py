"""Build the drafter an engine asked for: by name, from a trained drafter directory, or as given."""

from __future__ import annotations

import os
from collections.abc import Callable

from .base import Drafter, NoDraft
from .registry import KINDS, build_drafter_net, drafter_module, load_drafter
from .model import ModelDrafter
from .ngram import NgramDrafter


# the kinds whose weights come from training: named without weights they are refused unless `untrained=True`
TRAINED_KINDS = tuple(sorted(k for k in KINDS if k != "native"))


def no_weights_message(kind: str) -> str:
    """Why `drafter=kind` alone is refused, and where a drafter's weights come from."""
    return (f"drafter: {kind!r} names a drafter kind but gives it no weights, and an untrained {kind} head drafts "
            f"tokens the target rejects (tau about 1: slower than plain decoding). Weights come from a trained drafter "
            f"directory (drafter='path/to/dir', e.g. the embedded model's specdec/embedded/drafters/{kind}; "
            f"python -m specdec draft-train writes one), drafter='native' (the MTP layers of the target's own "
            f"checkpoint), or for eagle an EAGLE-3 checkpoint (drafter='eagle', draft_model=DIR). untrained=True "
            f"builds the untrained head anyway (training, benchmarks of its cost).")


def make_drafter(drafter, target_model, *, gamma: int, max_batch_size: int, max_length: int, draft_model=None,
                 runner_factory: Callable | None = None, untrained: bool = False, **drafter_kwargs) -> Drafter:
    """-> the drafter for `target_model`.

    `drafter`: a `Drafter` (returned as is), None or 'none' (`NoDraft`: plain decoding), 'ngram', 'model' (needs
    `draft_model`, same vocabulary, and `runner_factory`), 'native' (the MTP layers in the target's checkpoint;
    option `native_path`), 'eagle' with `draft_model=DIR` (an EAGLE-3 checkpoint in the SpecForge / SGLang
    format), a trained drafter directory or an EAGLE-3 directory. A trained kind alone ('mtp', 'eagle', 'dspark')
    is a `ValueError` (`no_weights_message`) unless `untrained=True`: then an untrained net of that kind sized for
    the target (training, benchmarks). `gamma`: drafts per round; `max_batch_size`, `max_length`: the engine's
    limits.
    `runner_factory`: a callable with `specdec.runner.make_runner`'s signature, for drafters that run a model
    of their own. `drafter_kwargs`: the drafter's own options.
    """
    if not isinstance(untrained, bool):
        raise ValueError(f"untrained: expected True or False, got {untrained!r}")
    if untrained:  # explicit: an untrained head is only ever wanted on purpose
        if not (isinstance(drafter, str) and drafter in TRAINED_KINDS) or draft_model is not None:
            raise ValueError(f"untrained: builds an untrained net of a trained kind (drafter one of "
                             f"{list(TRAINED_KINDS)}, no draft_model), not for drafter={drafter!r}"
                             + (" with a draft_model" if draft_model is not None else ""))
        net = build_drafter_net(drafter, target_model)
        return drafter_module(drafter).make_drafter(net, gamma=gamma, max_batch_size=max_batch_size, **drafter_kwargs)
    if isinstance(drafter, Drafter):
        return drafter
    if drafter is None or (isinstance(drafter, str) and drafter == "none"):  # plain decoding
        if drafter_kwargs:
            raise ValueError(f"{next(iter(drafter_kwargs))}: not an option of drafter=None (plain decoding "
                             f"takes none)")
        return NoDraft()
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
        from . import native, native_drafter
        net = native.build(target_model, native_path=drafter_kwargs.pop("native_path", None))
        return native_drafter.make_drafter(net, gamma=gamma, max_batch_size=max_batch_size, **drafter_kwargs)
    if drafter == "eagle" and draft_model is not None:  # a published EAGLE-3 checkpoint (SpecForge / SGLang)
        from . import eagle3_format
        return eagle3_format.make_drafter(draft_model, target_model, gamma=gamma, max_batch_size=max_batch_size,
                                          **drafter_kwargs)
    if isinstance(drafter, (str, os.PathLike)) and os.path.isdir(drafter):
        from . import eagle3_format
        if eagle3_format.is_eagle3_dir(drafter):
            return eagle3_format.make_drafter(drafter, target_model, gamma=gamma, max_batch_size=max_batch_size,
                                              **drafter_kwargs)
    if isinstance(drafter, str) and drafter in TRAINED_KINDS:  # refused before anything is built
        raise ValueError(no_weights_message(drafter))
    if isinstance(drafter, (str, os.PathLike)) and os.path.isdir(drafter):
        net = load_drafter(os.fspath(drafter), target_model)
        return drafter_module(net.config.kind).make_drafter(net, gamma=gamma, max_batch_size=max_batch_size,
                                                            **drafter_kwargs)
    if isinstance(drafter, os.PathLike) or (isinstance(drafter, str) and (os.sep in drafter or drafter.startswith("."))):
        raise ValueError(f"drafter: no such directory: {os.fspath(drafter)!r} (a trained drafter directory was "
                         f"expected there)")
    raise ValueError(f"drafter: expected None (plain decoding), 'ngram', 'model', 'native', one of {sorted(KINDS)}, "
                     f"a trained drafter directory or a Drafter instance, got {drafter!r}")
