"""The DFlash backbone: Qwen3-style draft layers that attend to target context features.

Read top to bottom: the target description, the draft config derived from it, the building
blocks (norm, rotary, attention, MLP), one decoder layer and the backbone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from algorithms.blocks import AttentionTile
from algorithms.conv import GroupedDynamicConv
from algorithms.knobs import knob_error


@dataclass
class TargetSpec:
    """What the draft needs to know about its verifier (no weights)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The target's RoPE frequency scaling as its config states it (`rope_type` plus that type's fields), None
    # when unscaled: the draft attends over the target's positions, so it rotates them the same way.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    name_or_path: str = ""
    architectures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TargetLayers:
    """The verifier's decoder tensors a draft can start from (`draft_init: target`): each layer's by its name within
    the layer (Hugging Face's: `self_attn.q_proj.weight`, ...) and the final norm's weight."""

    layers: Sequence[Mapping[str, torch.Tensor]]
    final_norm: torch.Tensor


@dataclass
class DraftConfig:
    """The resolved draft decoder: target shapes plus the knobs that change the network."""

    target: TargetSpec
    num_layers: int
    block_size: int
    target_layer_ids: list[int]  # speculators aux ids
    mask_token_id: int
    causal_blocks: bool
    sliding_window: int
    conv_kernel_size: int | None = None  # None: plain DFlash layers
    conv_group_size: int | None = None

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    def validate(self) -> None:
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise knob_error(
                "mask_token_id", self.mask_token_id, f"an existing token id in [0, {self.target.vocab_size})"
            )
        if self.conv_group_size is not None and self.hidden_size % self.conv_group_size:
            raise knob_error(
                "conv_group_size",
                self.conv_group_size,
                f"a divisor of the hidden size {self.hidden_size}",
            )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: frequencies whose wavelength exceeds the original context / low_freq_factor
    slow down by `factor`, those shorter than original context / high_freq_factor stay, and the band between
    blends the two linearly in original context / wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed fully, 1: kept
    return inv_freq / factor * (1 - blend) + inv_freq * blend


# RoPE scalings the draft reproduces, by the `rope_type` a config names; each maps unscaled inverse frequencies
# to scaled ones. Types that also rescale attention (yarn, longrope) or depend on the length (dynamic) are refused.
ROPE_SCALINGS = {
    "default": lambda inv_freq, scaling: inv_freq,
    "linear": lambda inv_freq, scaling: inv_freq / scaling["factor"],
    "llama3": llama3_frequencies,
}
# The config fields each scaled type reads.
ROPE_SCALING_FIELDS = {
    "linear": ["factor"],
    "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
}


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, device=None) -> torch.Tensor:
    """The per-pair rotation frequencies [head_dim / 2], scaled as the target's config says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    scaling = scaling or {"rope_type": "default"}
    return ROPE_SCALINGS[scaling["rope_type"]](inv_freq, scaling)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for the given positions, [L, head_dim] each."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, L, d]; rotate-half convention of Llama/Qwen."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block] through the same projections."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        t = config.target
        self.num_heads, self.num_kv_heads, self.head_dim = t.num_attention_heads, t.num_key_value_heads, t.head_dim
        self.q_proj = nn.Linear(t.hidden_size, t.num_attention_heads * t.head_dim, bias=False)
        self.k_proj = nn.Linear(t.hidden_size, t.num_key_value_heads * t.head_dim, bias=False)
        self.v_proj = nn.Linear(t.hidden_size, t.num_key_value_heads * t.head_dim, bias=False)
        self.o_proj = nn.Linear(t.num_attention_heads * t.head_dim, t.hidden_size, bias=False)
        self.q_norm = RMSNorm(t.head_dim, t.rms_norm_eps)
        self.k_norm = RMSNorm(t.head_dim, t.rms_norm_eps)

    def forward(
        self,
        block: torch.Tensor,  # [M, H]
        context: torch.Tensor,  # [T, H]
        rotary_q: tuple[torch.Tensor, torch.Tensor],  # [M, d]
        rotary_k: tuple[torch.Tensor, torch.Tensor],  # [T+M, d]
        tiles: list[AttentionTile],  # block-sparse layout covering the M queries in order
    ) -> torch.Tensor:
        queries, context_length = block.shape[0], context.shape[0]
        keys_in = torch.cat([context, block], dim=0)
        q = self.q_norm(self.q_proj(block).view(queries, self.num_heads, self.head_dim)).transpose(0, 1)
        k = self.k_norm(self.k_proj(keys_in).view(-1, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(keys_in).view(-1, self.num_kv_heads, self.head_dim).transpose(0, 1)
        q, k = apply_rotary(q, *rotary_q), apply_rotary(k, *rotary_k)
        outputs = []
        for tile in tiles:
            own = slice(context_length + tile.queries.start, context_length + tile.queries.stop)
            tile_k = torch.cat([k[:, tile.context], k[:, own]], dim=1)
            tile_v = torch.cat([v[:, tile.context], v[:, own]], dim=1)
            outputs.append(
                F.scaled_dot_product_attention(
                    q[None, :, tile.queries],
                    tile_k[None],
                    tile_v[None],
                    attn_mask=tile.mask[None, None],
                    enable_gqa=True,
                )[0]
            )
        out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
        return self.o_proj(out.transpose(0, 1).reshape(queries, -1))


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        h, i = config.target.hidden_size, config.target.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm residual layer; DFlash2 wraps attention and MLP in grouped dynamic convs."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        t = config.target
        self.input_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if config.conv_kernel_size is not None:
            self.attention_conv = GroupedDynamicConv(t.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(t.hidden_size, config.conv_kernel_size, config.conv_group_size)

    @staticmethod
    def _wrapped(conv: GroupedDynamicConv | None, sublayer, u: torch.Tensor, block_len: int) -> torch.Tensor:
        if conv is None:
            return sublayer(u)
        delta = conv.dynamic_taps(u)  # both sides' taps come from the normed input
        return conv(sublayer(conv(u, delta, side=0, block_len=block_len)), delta, side=1, block_len=block_len)

    def forward(self, x, context, rotary_q, rotary_k, tiles: list[AttentionTile], block_len: int) -> torch.Tensor:
        u = self.input_layernorm(x)
        x = x + self._wrapped(
            self.attention_conv, lambda y: self.self_attn(y, context, rotary_q, rotary_k, tiles), u, block_len
        )
        v = self.post_attention_layernorm(x)
        return x + self._wrapped(self.mlp_conv, self.mlp, v, block_len)


class DraftBackbone(nn.Module):
    """fc + hidden_norm over target features, L draft layers, final norm, frozen verifier embed/head."""

    def __init__(self, config: DraftConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> None:
        super().__init__()
        config.validate()
        t = config.target
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * t.hidden_size, t.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        # Frozen verifier tensors: buffers, so they never reach an optimizer or a checkpoint.
        self.register_buffer("embed_weight", embed_weight.detach().float().clone(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach().float().clone(), persistent=False)
        # Not the overridable reset_parameters: subclasses add modules after this constructor returns.
        self._init_backbone()

    def reset_parameters(self) -> None:
        self._init_backbone()

    def _init_backbone(self) -> None:
        std = 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.reset_parameters()  # identity init, re-applied after generic init

    # What a draft layer must take from a target layer for the copy to mean anything: its projections
    COPIED_FROM_TARGET = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
        f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    )

    @torch.no_grad()
    def init_from_target(self, target: TargetLayers) -> None:
        """Start as the target's own layers: draft layer j copies target layer first + j, where `first` is the layer
        the last fed hidden state enters (moved down so that every draft layer has one); `hidden_norm` copies that
        layer's input norm and `fc` passes the last hidden state through unchanged, so (unless moved) the context
        values of draft layer 0 are the ones target layer `first` computes. The final norm is the target's; what a
        target layer lacks (a conv, a q/k norm) keeps its own init."""
        count = len(self.layers)  # no deeper than the target's: draft_config checks
        first = min(self.config.target_layer_ids[-1], len(target.layers) - count)
        for layer, source in zip(self.layers, target.layers[first : first + count], strict=True):
            own = layer.state_dict()
            missing = [name for name in self.COPIED_FROM_TARGET if name not in source]
            if missing:
                raise knob_error("draft_init", "target", f"random for a target whose layers lack {missing}")
            layer.load_state_dict(
                {name: value for name, value in source.items() if name in own and own[name].shape == value.shape},
                strict=False,
            )
        self.hidden_norm.weight.copy_(target.layers[first]["input_layernorm.weight"])
        self.norm.weight.copy_(target.final_norm)
        hidden = self.fc.out_features
        self.fc.weight.zero_()
        self.fc.weight[:, -hidden:] = torch.eye(hidden)

    def logit_transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The verifier's final-logit transform: multiplier then softcap, before any top-K."""
        t = self.config.target
        if t.output_multiplier != 1.0:
            logits = logits * t.output_multiplier
        if t.final_logit_softcapping:
            logits = t.final_logit_softcapping * torch.tanh(logits / t.final_logit_softcapping)
        return logits

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformed logits of final-normed states through the frozen head, in fp32 (or the head's wider dtype)."""
        dtype = torch.promote_types(self.head_weight.dtype, torch.float32)
        return self.logit_transform(F.linear(hidden.to(dtype), self.head_weight.to(dtype)))

    def forward(
        self,
        features: torch.Tensor,  # [T, n_T*H]
        context_positions: torch.Tensor,  # [T]
        block_input_ids: torch.Tensor,  # [M]
        block_positions: torch.Tensor,  # [M]
        tiles: list[AttentionTile],  # block-sparse attention layout
        block_len: int,
    ) -> torch.Tensor:
        """Final-normed draft hidden states h [M, H] (the lm_head input)."""
        t = self.config.target
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(features.to(dtype)))
        x = (self.embed_weight[block_input_ids] * t.input_embedding_scale).to(dtype)
        rotary_k = rotary_cos_sin(
            torch.cat([context_positions, block_positions]), t.head_dim, t.rope_theta, dtype, t.rope_scaling
        )
        rotary_q = (rotary_k[0][-block_positions.shape[0] :], rotary_k[1][-block_positions.shape[0] :])
        for layer in self.layers:
            x = layer(x, context, rotary_q, rotary_k, tiles, block_len)
        return self.norm(x)
