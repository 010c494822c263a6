"""Tiny random models of transformers' own classes, and a switch to transformers' pure-torch paths."""

from __future__ import annotations

import contextlib
import copy
import itertools
import weakref

import torch

from specdec.hf_compat import FAMILIES, MORE_FAMILIES, torch_fallbacks  # noqa: F401  (re-exported for the tests)


def tiny_config(family: str, *, vocab_size: int = 96, num_layers: int = 4):
    """A 4-layer config (3 linear + 1 full attention) of `family`, hidden 64."""
    layer_types = ["linear_attention"] * (num_layers - 1) + ["full_attention"]
    if family == "kimi_linear":
        from transformers import KimiLinearConfig
        return KimiLinearConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_token=2,
            num_shared_experts=1, linear_num_heads=2, linear_head_dim=16, layer_types=layer_types,
            mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1), pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_hidden_layers=num_layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            layer_types=layer_types, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        return Qwen3_5TextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, layer_types=layer_types,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig
        return Qwen3_5MoeTextConfig(
            vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, layer_types=layer_types, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
    if family in ("olmo_hybrid", "olmo_hybrid_nope"):  # nope: no RoPE, as the released checkpoints
        from transformers import OlmoHybridConfig
        config = OlmoHybridConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, layer_types=layer_types, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
        if family == "olmo_hybrid_nope":
            config.rope_parameters = None
        return config
    if family == "bailing_hybrid":
        from transformers import BailingHybridConfig
        return BailingHybridConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2, head_dim=16, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, layer_types=layer_types,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(family)


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, attn_implementation: str = "eager",
               **kw):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw), dtype=dtype,
                                             experts_implementation="eager", attn_implementation=attn_implementation)
    if family == "bailing_hybrid" and dtype == torch.float64:
        model.double()  # its conv weight stays fp32 (`_keep_in_fp32_modules_strict`): transformers' conv then fails
    return model.eval()


class Memo(dict):
    """`memo(key)`: `build(key)`, built on the first call and kept (a test module's models and nets, each made once,
    in the order the tests first ask for them)."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def __missing__(self, key):
        self[key] = value = self.build(key)
        return value

    __call__ = dict.__getitem__


def noisy_copy(target, scale: float = 1e-3, seed: int = 123):
    """A copy of `target` plus `scale * randn` (a generator seeded `seed`) on every weight: a draft model that mostly
    agrees with the target's argmax, not always (partial acceptance)."""
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return draft


def remove_module(model, layer_idx: int, path: tuple[str, ...], name: str):
    """`model` with the submodule `name` of decoder layer `layer_idx` (reached through the attributes `path`) deleted:
    a model that lacks what its adapter expects."""
    owner = model.model.layers[layer_idx]
    for attr in path:
        owner = getattr(owner, attr)
    delattr(owner, name)
    return model


class _Float64Mode(torch.overrides.TorchFunctionMode):
    """Every float32 request becomes float64: `.float()`, `.to(torch.float32)`, `dtype=torch.float32`."""

    @staticmethod
    def _swap(x):
        return torch.float64 if x is torch.float32 else x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: self._swap(v) for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(self._swap(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_everywhere():
    """Run code in float64 throughout. transformers computes its linear-attention layers in float32 even in a
    float64 model (and keeps the recurrent state in float32), so float64 comparisons run both sides under this."""
    with _Float64Mode():
        yield


def exact_joint(model, prompt: list[int], params, new: int, *, families=()) -> torch.Tensor:
    """`[V] * new`: the model's own probability of every continuation of `prompt` by `new` tokens, under the
    sampling transform `params` (verify.probs_from_logits) — the oracle of the statistical tests.

    One forward over all `V ** (new - 1)` prefixes, in float64 with transformers' pure-torch layers."""
    from specdec.verify import probs_from_logits
    V = model.config.get_text_config().vocab_size
    tails = torch.tensor(list(itertools.product(range(V), repeat=new - 1)), dtype=torch.long).view(-1, new - 1)
    ids = torch.cat([torch.tensor(prompt).expand(tails.shape[0], -1), tails], 1)
    with torch.no_grad(), torch_fallbacks(*families), float64_everywhere():
        logits = model(ids).logits[:, -new:].double()
    probs = probs_from_logits(logits, params).view(*([V] * (new - 1)), new, V)
    joint = probs[(0,) * (new - 1) + (0,)]  # p(t1)
    for i in range(1, new):
        # p(t_{i+1} | t_1..t_i): rows whose first i tail tokens are the prefix (later ones are irrelevant)
        joint = joint.unsqueeze(-1) * probs[(slice(None),) * i + (0,) * (new - 1 - i) + (i,)]
    assert abs(joint.sum().item() - 1.0) < 1e-9
    return joint


def tiny_tokenizer():
    """A byte-level BPE (320 tokens: <pad>=0, <bos>=1, <eos>=2, the 256 bytes, merges) trained on stdlib code."""
    import inspect
    import textwrap

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([inspect.getsource(textwrap)[:8000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


_GREEDY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(prompt, new): tokens}


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate of `prompt` (float64 throughout, pure-torch layers, no EOS stop):
    the oracle of the greedy-identity tests. Memoized per model object (test targets are never modified)."""
    cache = _GREEDY.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens)
    if key not in cache:
        with torch_fallbacks(), float64_everywhere():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=None)
        cache[key] = out[0].tolist()
    return list(cache[key])


def assert_greedy(out, target, prompts, max_new_tokens: int, msg: str = "") -> None:
    """Every row of `out` (an engine's `generate` of `prompts`, no EOS stop) starts with `greedy_reference` of its
    prompt: the greedy-identity check."""
    for b, p in enumerate(prompts):
        ref = greedy_reference(target, p, max_new_tokens)
        assert out.sequences[b, :len(ref)].tolist() == ref, f"{msg}row {b} differs from transformers' greedy generate"


def generate_f64(engine, prompts, **kw):
    """`engine.generate` of `prompts` (lists of token ids) with no EOS stop, in float64 throughout with transformers'
    pure-torch layers: the engine side of a comparison with `greedy_reference`."""
    with torch_fallbacks(), float64_everywhere():
        return engine.generate([torch.tensor(p) for p in prompts], eos_token_id=None, **kw)


def save_tiny(path, family: str, *, seed: int = 0):
    """A tiny float32 model of `family` with `tiny_tokenizer()` saved to `path`; -> (model, tokenizer)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(family, seed=seed, dtype=torch.float32, vocab_size=len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def save_with_mtp(path, family: str, *, seed: int = 0, mtp_seed: int = 5, mtp: bool = True, **kw):
    """A float64 tiny `family` model saved to `path` with the MTP layers its published checkpoints ship, added
    to its safetensors under their published names (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE: `mtp.fc.weight`,
    `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.layers.0.*`, `mtp.norm.weight`;
    Bailing-Hybrid: `model.layers.{num_hidden_layers}.{eh_proj, enorm, hnorm, final_layernorm}.weight` and the
    layer's own tensors). The MTP decoder layer is the last (full-attention) layer's tensors, as saved, plus
    seeded noise. `kw` goes to `tiny_config`. -> the model reloaded with `from_pretrained(path)` (so
    `config._name_or_path` is `path`)."""
    import os

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tiny_model(family, seed=seed, **kw).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if mtp:
        config = tiny_config(family, **kw)
        L, d = config.num_hidden_layers, config.hidden_size
        last = f"model.layers.{L - 1}."
        gen = torch.Generator().manual_seed(mtp_seed)

        def noisy(t):
            return t + 0.02 * torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.is_floating_point() else t

        if family == "bailing_hybrid":
            pre, names = f"model.layers.{L}.", ("eh_proj", "enorm", "hnorm", "final_layernorm")
            norm_base = 1.0  # x * w
        else:
            pre, names = "mtp.", ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
            norm_base = 0.0  # zero-centred: x * (1 + w)
        layer = pre if family == "bailing_hybrid" else pre + "layers.0."
        extra = {layer + k[len(last):]: noisy(v) for k, v in tensors.items() if k.startswith(last)}
        extra[pre + names[0] + ".weight"] = 0.1 * torch.randn(d, 2 * d, generator=gen, dtype=torch.float64)
        for n in names[1:]:
            extra[pre + n + ".weight"] = norm_base + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
        tensors.update(extra)
        save_file(tensors, file, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager",
                                                 attn_implementation="eager")
    if family == "bailing_hybrid":
        model.double()  # as tiny_model: its fp32-kept conv would fail in transformers' float64 forward
    return model.eval()
