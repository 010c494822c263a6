"""Writing a fine-tuned native net back into its checkpoint.

Shipping a fine-tune: `write_mtp(net, DIR)` (command line: `python -m specdec native-export --target DIR
--drafter TRAINED [--out NEW]`) writes the net's weights back into a checkpoint under the same names, so the
checkpoint's own `drafter="native"` is the fine-tuned one.
"""

from __future__ import annotations

import os

import torch

from .native import LING_HEAD, QWEN_HEAD, Net, checkpoint_files, decoder_layer, mtp_prefix


def checkpoint_tensors(net: Net, target) -> dict[str, torch.Tensor]:
    """The net's own weights under the checkpoint's names (the inverse of `split_mtp_tensors`), checked by reading
    the layer back through `decoder_layer` (a layer whose stored form differs from its modules', such as fused
    experts, is refused)."""
    prefix = mtp_prefix(target)
    names = LING_HEAD if target.config.model_type == "bailing_hybrid" else QWEN_HEAD
    ours = {v: k for k, v in names.items()}
    layer_prefix = "" if target.config.model_type == "bailing_hybrid" else "layers.0."
    layer = {k: v.detach().cpu() for k, v in net.layer.state_dict().items()}
    back = decoder_layer(target, layer, where="the fine-tuned net").state_dict()
    if back.keys() != layer.keys() or any(not torch.equal(back[k].cpu(), v.to(back[k].dtype))
                                          for k, v in layer.items()):
        raise ValueError("write_mtp: this MTP layer's stored form differs from its modules (fused experts?); "
                         "only layers whose tensors round-trip can be written back")
    out = {prefix + ours[n]: p.detach().cpu() for n, p in net.named_parameters() if n in ours}
    out.update({prefix + layer_prefix + k: v for k, v in layer.items()})
    return out


def write_mtp(net: Net, target, path: str) -> list[str]:
    """Replace the MTP tensors in the checkpoint directory `path` (the file(s) holding them, in their stored dtype)
    with `net`'s weights. -> the files written."""
    from safetensors.torch import load_file, save_file
    files = checkpoint_files(path)
    new = checkpoint_tensors(net, target)
    prefix = mtp_prefix(target)
    holding = [f for f in files if any(k.startswith(prefix) for k in _keys(f))]
    if not holding:
        raise ValueError(f"write_mtp: no MTP tensors ('{prefix}*') in {', '.join(files)} to replace")
    written = []
    for f in holding:
        state = load_file(f)
        stored = {k: v for k, v in state.items() if k.startswith(prefix)}
        missing = sorted(set(stored) - set(new))
        if missing:
            raise ValueError(f"write_mtp: {f} holds MTP tensors the net has none for: {missing[:4]}")
        for k, v in stored.items():
            if v.shape != new[k].shape:
                raise ValueError(f"write_mtp: {k} is {list(v.shape)} in {f}, {list(new[k].shape)} in the net")
            state[k] = new[k].to(v.dtype).contiguous()
        save_file(state, f + ".tmp", metadata={"format": "pt"})
        os.replace(f + ".tmp", f)
        written.append(f)
    stored = set().union(*(set(k for k in _keys(f) if k.startswith(prefix)) for f in holding))
    if stored != set(new):
        raise ValueError(f"write_mtp: the net has tensors the checkpoint does not: {sorted(set(new) - stored)[:4]}")
    return written


def _keys(file: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(file, "pt") as f:
        return list(f.keys())
