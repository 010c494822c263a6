"""The trained drafter kinds: their registry, configs, save / load, and the target batches they learn from.

A trained drafter kind is two modules. Its training side (`draft/mtp.py`, `draft/eagle.py`, `draft/dspark.py`,
`draft/native.py`: `kind_module`) exposes `Config` (a flat dataclass subclassing `DraftConfig`) and `Net` (an
`nn.Module` with `from_target(target, config)`, `loss(batch)`, `evaluate(batch)` over a `TargetBatch`); its drafter
(`draft/<kind>_drafter.py`: `drafter_module`) exposes `make_drafter(net, *, gamma, max_batch_size, **options)`,
the `Drafter` an engine runs. Nets share the target's embedding and lm_head by reference; only their own weights are
saved. Their building blocks are in `draft/layers.py`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

KINDS = {"mtp": "specdec.draft.mtp", "eagle": "specdec.draft.eagle", "dspark": "specdec.draft.dspark",
         "native": "specdec.draft.native"}  # native: the target checkpoint's own MTP layers, fine-tuned


@dataclass
class DraftConfig:
    """Fields every drafter kind has; kinds add their own (flat)."""

    kind: str = ""
    target_model_type: str = ""
    target_hidden_size: int = 0
    target_vocab_size: int = 0
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 256
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    feature_layers: list[int] = field(default_factory=list)

    @classmethod
    def for_target(cls, target, **overrides) -> "DraftConfig":
        tc = target.config.get_text_config()
        base = dict(target_model_type=target.config.model_type, target_hidden_size=tc.hidden_size,
                    target_vocab_size=tc.vocab_size)
        base.update(overrides)
        return cls(**base)


def kind_module(kind: str):
    """The training side of `kind`: its `Config` and `Net`."""
    if kind not in KINDS:
        raise ValueError(f"drafter: unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    return importlib.import_module(KINDS[kind])


def drafter_module(kind: str):
    """The drafter of `kind`: its `make_drafter(net, ...)`."""
    return importlib.import_module(kind_module(kind).__name__ + "_drafter")


def check_target(cfg: DraftConfig, target, *, where: str = "drafter") -> None:
    """A drafter only runs on the target it was built for (hidden size, vocab)."""
    tc = target.config.get_text_config()
    if cfg.target_hidden_size != tc.hidden_size or cfg.target_vocab_size != tc.vocab_size:
        raise ValueError(f"{where}: trained for a target with hidden size {cfg.target_hidden_size} and vocab "
                         f"{cfg.target_vocab_size}, but this target has hidden size {tc.hidden_size} and vocab "
                         f"{tc.vocab_size}")


def own_state_dict(net: nn.Module) -> dict[str, torch.Tensor]:
    """The net's parameters without the shared target modules (attribute names starting with `target_`)."""
    return {k: v for k, v in net.state_dict().items() if not k.split(".")[0].startswith("target_")}


def to_target(net: nn.Module, target) -> nn.Module:
    """Move/cast the net's own weights to the target's device and dtype; shared `target_*` modules untouched."""
    ref = next(target.parameters())
    for name, mod in net.named_children():
        if not name.startswith("target_"):
            mod.to(device=ref.device, dtype=ref.dtype)
    for name, p in list(net.named_parameters(recurse=False)):
        p.data = p.data.to(device=ref.device, dtype=ref.dtype)
    return net


def save_drafter(net: nn.Module, out_dir: str) -> None:
    """`config.json` + `model.safetensors` (own weights only)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(net.config), f, indent=2)
    save_file({k: v.detach().contiguous().cpu() for k, v in own_state_dict(net).items()},
              os.path.join(out_dir, "model.safetensors"))


def load_drafter(path: str, target) -> nn.Module:
    """Load a saved drafter for `target`; a clear `ValueError` for a wrong file or another target."""
    from safetensors.torch import load_file
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"drafter: {path!r} is not a drafter directory (no config.json)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
        kind = raw["kind"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"drafter: {cfg_path} is not a drafter config ({type(e).__name__}: {e})") from None
    mod = kind_module(kind)
    known = {f.name for f in dataclasses.fields(mod.Config)}
    cfg = mod.Config(**{k: v for k, v in raw.items() if k in known})
    check_target(cfg, target)
    net = mod.Net.from_target(target, cfg)
    weights_path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights_path):
        raise ValueError(f"drafter: {path!r} has no model.safetensors")
    try:
        state = load_file(weights_path)
    except Exception as e:  # safetensors raises its own error type for a corrupt file
        raise ValueError(f"drafter: cannot read {weights_path} ({type(e).__name__}: {e})") from None
    missing = set(own_state_dict(net)) - set(state)
    unexpected = set(state) - set(own_state_dict(net))
    if missing or unexpected:
        raise ValueError(f"drafter: {weights_path} does not match a {kind} drafter "
                         f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
    to_target(net, target)  # before loading, so fp64 weights stay exact
    net.load_state_dict(state, strict=False)
    return net


# the output projections of a residual block (`draft/layers.py`): zero, the block adds nothing to the stream
_BLOCK_OUTPUTS = ("attn.o_proj.weight", "mlp.down_proj.weight")


def grown_state_dict(old: dict[str, torch.Tensor], net: nn.Module) -> dict[str, torch.Tensor]:
    """`net`'s own weights taken from `old` (the own weights of a smaller drafter of the same kind) so that `net`
    computes what that drafter computed: blocks `layers.i` that `old` lacks keep `net`'s initial weights with
    their attention and MLP output projections zero (identity blocks, as in LLaMA Pro's block expansion), and an
    MLP wider than in `old` keeps `old`'s units first and zero output weights for the new ones. Training then
    starts from the smaller drafter's function. Any other difference of names or shapes is a `ValueError`."""
    new = own_state_dict(net)
    old_blocks = {k.split(".")[1] for k in old if k.startswith("layers.")}
    out: dict[str, torch.Tensor] = {}
    for k, v in new.items():
        if k not in old:
            if not (k.startswith("layers.") and k.split(".")[1] not in old_blocks):
                raise ValueError(f"drafter: the grown net has {k!r}, which the smaller one lacks")
            out[k] = torch.zeros_like(v) if k.endswith(_BLOCK_OUTPUTS) else v.detach().clone()
            continue
        o = old[k].to(device=v.device, dtype=v.dtype)
        if o.shape == v.shape:
            out[k] = o
        elif (k.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) and o.dim() == 2
              and o.shape[1] == v.shape[1] and o.shape[0] < v.shape[0]):
            out[k] = torch.cat([o, v.detach()[o.shape[0]:]])
        elif (k.endswith("mlp.down_proj.weight") and o.dim() == 2 and o.shape[0] == v.shape[0]
              and o.shape[1] < v.shape[1]):
            out[k] = torch.cat([o, v.new_zeros(v.shape[0], v.shape[1] - o.shape[1])], dim=1)
        else:
            raise ValueError(f"drafter: {k} is {tuple(o.shape)} in the smaller net and {tuple(v.shape)} in the "
                             "grown one (only more blocks and wider MLPs can be grown)")
    extra = sorted(set(old) - set(new))
    if extra:
        raise ValueError(f"drafter: the grown net lacks {extra[:4]}")
    return out


def build_drafter_net(kind: str, target, **overrides) -> nn.Module:
    """An untrained net of `kind` sized for `target` (seed torch for reproducible weights)."""
    mod = kind_module(kind)
    net = mod.Net.from_target(target, mod.Config.for_target(target, kind=kind, **overrides))
    return to_target(net, target)


def load_plain(path: str, *, what: str):
    """`torch.load` of a file the package saved (tensors, numbers, strings and containers of them) without running
    code: any other object in it (unpickling one can run code) is refused with a `ValueError` naming `what`."""
    import pickle
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((line.split("error:", 1)[1].split(". ")[0].strip() for line in str(e).splitlines()
                       if "WeightsUnpickler error:" in line), type(e).__name__)
        raise ValueError(f"{what}: {path!r} holds objects other than tensors, numbers, strings and containers "
                         f"({detail}); not loaded, since unpickling them can run code") from None


# ---- target batches ----------------------------------------------------------------------------------
@dataclass
class TargetBatch:
    """Target outputs over token windows (no grad): the distillation data of every drafter kind.

    tokens `[B, S]`; logits `[B, S, V]` (position t: the target's scores for token t+1); hidden `[B, S, d]`
    (final normed hidden state); features `{layer: [B, S, d]}` (decoder layer outputs).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    features: dict[int, torch.Tensor]


@torch.no_grad()
def target_batch(runner, ids: torch.Tensor, feature_layers=()) -> TargetBatch:
    """Run each row of `ids [B, S]` through the target runner (a fresh slot per row)."""
    outs = []
    for row in ids:
        slot = runner.alloc(1)
        try:
            outs.append(runner.prefill(slot[0], row, capture=tuple(feature_layers)))
        finally:
            runner.release(slot)
    return TargetBatch(ids, torch.cat([o.logits for o in outs]), torch.cat([o.hidden for o in outs]),
                       {i: torch.cat([o.captured[i] for o in outs]) for i in feature_layers})
