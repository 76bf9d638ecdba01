"""The static KV cache and the attention the static sampler decodes with.

`KVPool` owns one key and one value buffer per layer, (batch, kv_heads, length, head_dim),
sized to the largest bucket met so far. A bucket's cache is a transformers `StaticCache`
whose layers are views of the pool, so every bucket shares one allocation and a CUDA graph
of a bucket keeps fixed addresses. `StaticLayer` keeps its write position in a device tensor
(`cumulative_length`) and writes with `index_copy_`: graph-safe on transformers 5.17 and
5.24 alike (both read here); 5.24 renamed the forward's `past_key_values` argument `cache`,
which `cache_argument` finds from the model's signature.

`ATTENTION` is registered as a transformers attention function. For one query token it runs
SDPA on the key/value heads directly (the query's heads folded into the query-length axis,
as `pack_gqa` does in transformers 5.24): transformers 5.17's SDPA path would `repeat_kv`
the whole cache for a GQA model with a mask, copying it n_rep times per step. Longer
queries (the prefill) go to transformers' own SDPA function.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

ATTENTION = "distill_static"


class PoolCache(StaticCache):
    """A StaticCache over pool views, with `write`: the cache index the next decode token
    goes to (fused_layers writes there; the sampler advances it)."""


def cache_argument(model) -> str:
    """The name under which this transformers version's forward takes the cache."""
    names = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def check_supported(config) -> None:
    """Refuse, before anything is allocated, what the static decode loop would get wrong."""
    layers = StaticCache(config=config, max_cache_len=1).layers
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    if other:
        raise ValueError(f"the static sampler supports full-attention layers only; "
                         f"{config.model_type} has {other} (sliding or other layers): use "
                         "the HF sampler for this model")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("the static sampler does not support attention soft-capping "
                         f"({config.model_type}): use the HF sampler for this model")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"rope_type={kind!r} depends on the sequence length at run time "
                         "(a host sync per step): use the HF sampler for this model")


class KVPool:
    """Per-layer key/value buffers shared by every bucket; `views` hands out a bucket's cache."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
            else config
        self.config, self.dtype, self.device = config, dtype, device
        self.layers = text.num_hidden_layers
        self.heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or \
            text.hidden_size // text.num_attention_heads
        self.batch = self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fits(self, batch: int, length: int) -> bool:
        return batch <= self.batch and length <= self.length

    def grow(self, batch: int, length: int) -> None:
        """Reallocate to hold (batch, length): every cache handed out before is stale."""
        batch, length = max(batch, self.batch), max(length, self.length)
        self.keys = self.values = []  # free the old buffers before taking the new ones
        shape = (batch, self.heads, length, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in range(self.layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                       for _ in range(self.layers)]
        self.batch, self.length = batch, length

    def views(self, batch: int, length: int):
        """A PoolCache of (batch, length) whose layers write into the pool."""
        assert self.fits(batch, length)
        cache = PoolCache(config=self.config, max_cache_len=length)
        cache.write = torch.zeros((), dtype=torch.long, device=self.device)
        meta = torch.empty((batch, self.heads, 1, self.head_dim), dtype=self.dtype,
                           device="meta")
        for i, layer in enumerate(cache.layers):
            # the layer's own initialization sets its bookkeeping (free on meta); then the
            # storage is swapped for the pool's views and the position for a real tensor
            layer.lazy_initialization(meta, meta)
            layer.keys = self.keys[i][:batch, :, :length]
            layer.values = self.values[i][:batch, :, :length]
            layer.device = self.device
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
        return cache


def reset(cache) -> None:
    """Write position 0 in every layer, in place (the graphs read these tensors)."""
    for layer in cache.layers:
        layer.cumulative_length.zero_()


def static_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     **kwargs):
    """query (B, Hq, q, D); key, value (B, Hkv, L, D); attention_mask (B, 1, q, L) bool,
    True where a query attends. Returns (B, q, Hq, D), None, as transformers expects."""
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("the static sampler's attention has no soft-capping or sliding window")
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if q_len != 1 or groups == 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=0.0, scaling=scaling, is_causal=False)
    # heads h = j * groups + r share key head j (repeat_kv's order): fold r into the query axis
    folded = query.reshape(batch, key.shape[1], groups, dim)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                         scale=scaling)  # (B, Hkv, groups, D)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, static_attention)


class attention_as:
    """Set `config._attn_implementation` for a while (eager phases of a model the sampler does
    not own, such as the live teacher, whose training forward must keep its own)."""

    def __init__(self, config, name: str):
        self.config, self.name = config, name

    def __enter__(self):
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved
