"""A decoder's parameter names and shapes from its ``config.json`` alone, by arithmetic: what
`parablock-flwr plan` partitions, without importing transformers (seconds) to build the model.

Only the architectures below are known: Llama (SmolLM2 is one), Mistral, Qwen2 and Qwen3, whose
parameters follow from ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``vocab_size``, ``num_hidden_layers``, ``tie_word_embeddings``
and their bias switches; LoRA's adapters follow from ``lora-rank`` and ``lora-target-modules`` as PEFT
places them. For anything else, or a config these rules are not sure of, ``decoder_shapes`` returns
None and plan builds the model on the meta device. tests/test_plan.py holds every answer to
transformers' and PEFT's own model, name by name and shape by shape.
"""

from __future__ import annotations

from dataclasses import dataclass

Shapes = list[tuple[str, tuple[int, ...]]]  # (name, shape) in ``named_parameters`` order

ABSENT = object()  # a key config.json does not have (its architecture's default applies)
DERIVED = "derived"  # the default is computed from other keys (head_dim: hidden / heads; kv heads: heads)
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Decoder:
    """How one transformers architecture lays out a decoder layer and reads its config's keys."""

    kv_heads_default: int | str  # num_key_value_heads when absent (null: num_attention_heads)
    head_dim_default: int | str  # head_dim when absent
    head_dim_null: bool  # does head_dim = null mean hidden / heads (else the model cannot be built)
    qkv_bias: str | bool  # the config key that switches the q, k, v biases, or the fixed answer
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: bool  # an RMSNorm over head_dim on q and on k (Qwen3)


DECODERS = {
    "llama": Decoder(DERIVED, DERIVED, True, "attention_bias", "attention_bias", "mlp_bias", False),
    "mistral": Decoder(8, DERIVED, True, False, False, False, False),
    "qwen2": Decoder(32, DERIVED, False, True, False, False, False),
    "qwen3": Decoder(32, 128, False, "attention_bias", "attention_bias", False, True),
}


def decoder_shapes(values: dict, train: str = "full", lora_rank: int = 8, lora_targets: str = "") -> Shapes | None:
    """The parameters of ``AutoModelForCausalLM.from_config`` (with PEFT's LoRA adapters when ``train =
    "lora"``) as ``named_parameters`` lists them: tied weights once. None when the architecture or
    one of its values is outside what the rules above know."""
    arch = DECODERS.get(values.get("model_type"))
    dims = arch and _dims(arch, values)
    if dims is None:
        return None
    hidden, inter, heads, kv_heads, head_dim, layers, vocab = dims
    bias = {key: _flag(values, key) for key in (arch.qkv_bias, arch.o_bias, arch.mlp_bias)}
    tied = _flag(values, "tie_word_embeddings")
    if None in bias.values() or tied is None:
        return None
    linears = {
        "self_attn.q_proj": (heads * head_dim, hidden, bias[arch.qkv_bias]),
        "self_attn.k_proj": (kv_heads * head_dim, hidden, bias[arch.qkv_bias]),
        "self_attn.v_proj": (kv_heads * head_dim, hidden, bias[arch.qkv_bias]),
        "self_attn.o_proj": (hidden, heads * head_dim, bias[arch.o_bias]),
        "mlp.gate_proj": (inter, hidden, bias[arch.mlp_bias]),
        "mlp.up_proj": (inter, hidden, bias[arch.mlp_bias]),
        "mlp.down_proj": (hidden, inter, bias[arch.mlp_bias]),
    }
    adapted = _lora_targets(lora_targets) if train == "lora" else frozenset()
    if adapted is None:
        return None
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        layer = f"model.layers.{i}."
        for name, (out, inp, has_bias) in linears.items():
            shapes += _linear(layer + name, out, inp, has_bias, lora_rank if name.split(".")[1] in adapted else 0)
            if arch.qk_norm and name == "self_attn.o_proj":
                shapes += [(f"{layer}self_attn.{n}_norm.weight", (head_dim,)) for n in "qk"]
        shapes += [(f"{layer}{norm}_layernorm.weight", (hidden,)) for norm in ("input", "post_attention")]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return [("base_model.model." + n, s) for n, s in shapes] if train == "lora" else shapes


def _dims(arch: Decoder, values: dict) -> tuple[int, ...] | None:
    """hidden, intermediate, heads, kv heads, head_dim, layers, vocab; None if one is missing or odd."""
    if not all(_positive(values.get(k)) for k in REQUIRED):
        return None
    hidden, inter, heads, layers, vocab = (values[k] for k in REQUIRED)
    if hidden % heads:  # Llama's config refuses it: transformers says so
        return None
    kv_heads = values.get("num_key_value_heads", ABSENT)
    kv_heads = arch.kv_heads_default if kv_heads is ABSENT else kv_heads
    kv_heads = heads if kv_heads is None or kv_heads == DERIVED else kv_heads
    head_dim = values.get("head_dim", ABSENT)
    if head_dim is None and not arch.head_dim_null:
        return None
    head_dim = arch.head_dim_default if head_dim is ABSENT else head_dim
    head_dim = hidden // heads if head_dim is None or head_dim == DERIVED else head_dim
    if not (_positive(kv_heads) and _positive(head_dim)):
        return None
    return hidden, inter, heads, kv_heads, head_dim, layers, vocab


def _flag(values: dict, key: str | bool) -> bool | None:
    """A bias switch: fixed by the architecture, or the config's key (absent: off; not a bool: None)."""
    if isinstance(key, bool):
        return key
    value = values.get(key, False)
    return value if isinstance(value, bool) else None


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _lora_targets(targets: str) -> frozenset[str] | None:
    """The layer's linear modules PEFT adapts for ``lora-target-modules`` (``all-linear``: every one but
    the output head); None for a name that is not one of them (PEFT decides, or refuses it)."""
    if targets == "all-linear":
        return frozenset(ATTENTION + MLP)
    names = frozenset(m.strip() for m in targets.split(",") if m.strip())
    return names if names and names <= set(ATTENTION + MLP) else None


def _linear(name: str, out: int, inp: int, bias: bool, rank: int) -> Shapes:
    """An ``nn.Linear``'s parameters, or PEFT's LoRA layer around it (``rank`` > 0)."""
    base = name + ".base_layer" if rank else name
    shapes = [(base + ".weight", (out, inp))] + ([(base + ".bias", (out,))] if bias else [])
    if rank:
        shapes += [(name + ".lora_A.default.weight", (rank, inp)), (name + ".lora_B.default.weight", (out, rank))]
    return shapes
