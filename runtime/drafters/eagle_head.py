"""The EAGLE-3 draft head as a plain nn.Module: what prep trains and exports, and whose weights the runtime drafts with.

The head reads the target's own features: the residual stream entering three of its layers (low,
middle, high: `feature_layers`), side by side, fused by fc (3d -> d). One Llama decoder layer takes
[input_layernorm(embedding of the next token), hidden_norm(fused features)] (2d wide) into its
attention; the fused features are the layer's residual. The final norm and an LM head over a
reduced draft vocabulary (Vd most frequent target tokens; target id = i + d2t[i]) predict the token
after next. Later draft steps feed the layer's own output (its pre-norm residual) in place of fused
features. The tensor names are the EAGLE-3 checkpoint layout that vLLM (`Eagle3LlamaForCausalLM`),
SGLang (`LlamaForCausalLMEagle3`) and llama.cpp's converter load.

Training-time test (EAGLE-3): step j feeds row t the token t + 1 + j and step j - 1's output at row
t, at position t + j; its query sees step 0's keys at rows <= t (the target's features) and steps
1..j's keys at row t only (its own earlier drafts), exactly what a j-th draft step sees at run time.
The embedding table is the target's (rows as stored, no embedding scale), never trained.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ROPE_THETA = 10_000.0
NORM_EPS = 1e-6
NOT_DRAFTED = -1  # t2d_index of a target token outside the draft vocabulary


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input the head reads: (2, N // 2, N - 3), EAGLE-3's and vLLM's default."""
    if num_layers < 6:
        raise ValueError(f"an EAGLE-3 head needs a target of 6 layers or more, not {num_layers}")
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape: the target's hidden size and attention geometry, its own MLP width and draft vocabulary."""

    hidden_size: int  # d, the target's
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab: int  # Vd
    vocab_size: int  # V, the target's
    feature_layers: tuple[int, ...]
    rope_theta: float = DEFAULT_ROPE_THETA

    def params(self) -> dict:
        """As a stage's JSON parameters."""
        return {**asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_params(cls, params: dict) -> "EagleConfig":
        fields = {k: params[k] for k in cls.__dataclass_fields__}
        return cls(**{**fields, "feature_layers": tuple(fields["feature_layers"])})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """Llama's RMSNorm over the last dim: x * rsqrt(mean(x²) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama rotary tables (cos, sin) [T, hd] for positions [T]."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [hd / 2]
    angles = positions.float().unsqueeze(1) * inv  # [T, hd / 2]
    angles = torch.cat([angles, angles], dim=1)  # [T, hd]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, hd] rotated by position (Llama's rotate_half form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagleHead(nn.Module):
    """fc, one Llama layer over [embedding, features], the final norm and the draft-vocabulary LM head."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = self.config = config
        d, hd = c.hidden_size, c.head_dim
        self.fc = nn.Linear(len(c.feature_layers) * d, d, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(2 * d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, c.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab, dtype=torch.long))  # [Vd]: target id - draft id
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))  # [V]: in the draft vocabulary

    def set_vocabulary(self, draft_ids: torch.Tensor) -> None:
        """The draft vocabulary: target ids [Vd], ascending (d2t offsets are then >= 0, as the layouts expect)."""
        draft_ids = draft_ids.sort().values
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary entry [Vd]."""
        return torch.arange(self.config.draft_vocab) + self.d2t

    def t2d_index(self) -> torch.Tensor:
        """Draft index of each target id [V] (NOT_DRAFTED outside the draft vocabulary)."""
        index = torch.full((self.config.vocab_size,), NOT_DRAFTED, dtype=torch.long)
        index[self.draft_ids()] = torch.arange(self.config.draft_vocab)
        return index

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Rotated q [H, T, hd] and k, v [KV, T, hd] of rows with token embeddings and hidden inputs [T, d]."""
        c = self.config
        x = torch.cat([rms_norm(embeds, self.input_layernorm), rms_norm(hidden, self.hidden_norm)], dim=-1)  # [T, 2d]
        q = self.q_proj(x).view(-1, c.num_heads, c.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(-1, c.kv_heads, c.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(-1, c.kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = rotary(positions, c.head_dim, c.rope_theta)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, d] from its residual (the hidden input) and attention output [T, H hd]."""
        x = hidden + self.o_proj(attended)
        h = rms_norm(x, self.post_attention_layernorm)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] of layer outputs [T, d]."""
        return self.lm_head(rms_norm(out, self.norm))

    def unrolled(self, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over one text: the layer outputs [T', d] of each of `steps` draft steps.

        features: [T', 3d], the target's features at rows 0..T'-1; embeds: [T' + steps - 1, d], the
        embeddings of the tokens after each row (row t of step j reads embeds[t + j]).
        """
        rows = features.shape[0]
        hidden = self.fc(features)  # [T', d]
        base = torch.arange(rows)
        causal = base.unsqueeze(1) >= base.unsqueeze(0)  # [T', T'] step 0: rows <= t
        diagonal = torch.eye(rows, dtype=torch.bool)  # later steps: row t only
        keys, values, outs = [], [], []
        for j in range(steps):
            q, k, v = self.qkv(embeds[j : j + rows], hidden, base + j)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * j, dim=1)  # [T', (j + 1) T']
            attended = F.scaled_dot_product_attention(
                q.unsqueeze(0), torch.cat(keys, 1).unsqueeze(0), torch.cat(values, 1).unsqueeze(0), attn_mask=mask,
                enable_gqa=self.config.num_heads != self.config.kv_heads,
            )[0]  # [H, T', hd]
            hidden = self.finish(hidden, attended.transpose(0, 1).reshape(rows, -1))
            outs.append(hidden)
        return outs
