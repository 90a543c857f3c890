"""A decoder-only GPT whose norm and norm placement are parameters.

A placement is nothing but which norm slots around a sublayer f are filled:

    pre slot            branch slot             post slot
    x ──► Norm (× s) ──► f ──► Norm_out ──► a ⊙ ──► (+ α·x) ──► Norm ──► x'

`pre` fills the pre slot, `post` the post slot, `sandwich` the pre and branch
slots, `reordered` the branch slot alone, `deepnorm` the post slot with α = (2N)^(1/4),
`mix` the post slot in its first ⌊pN⌋ blocks and the pre slot in the rest, and `lns`
the pre slot with s = 1/sqrt(ℓ) in block ℓ (config.PLACEMENT_TRAITS). The residual gate a
(ReZero, LayerScale) is a switch, as are a norm on the embedding (`norm_embed`) and the
final norm (`norm_f`). QK-norm is orthogonal: a norm on queries and keys (`attn.q_norm`,
`attn.k_norm`). Module names are stable across arms (`blocks.3.norm1`,
`blocks.3.norm1_out`, `blocks.3.gate1`, `blocks.3.attn`, `blocks.3.mlp`, `norm_f`); an
unused slot holds `nn.Identity`. The model knows nothing of Hydra, wandb or telemetry: it
shows its tensors to a tap (normlab.nn.tap) when given one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from normlab.config import NORM_TRAITS, PLACEMENT_TRAITS, RunConfig
from normlab.config.validate import AUTO_FINAL_NORM, tokenizer_vocab
from normlab.nn.norms import build_norm
from normlab.nn.sublayers import MLP, CausalSelfAttention
from normlab.nn.tap import Tap, tapped


@dataclass(frozen=True)
class Slots:
    """Which norm slots one block's sublayers fill, and the residual scale α."""

    pre: bool
    post: bool
    alpha: float = 1.0
    branch: bool = False  # a norm on the sublayer's output, before the residual add (sandwich, reordered)
    pre_scale: float = 1.0  # the pre slot's norm output × this (LayerNorm Scaling: 1/sqrt(ℓ))


def deepnorm_alpha(depth: int) -> float:
    """DeepNorm's residual scale for a decoder-only model of `depth` blocks: (2N)^(1/4) (Wang et al. 2022)."""
    return (2 * depth) ** 0.25


def deepnorm_beta(depth: int) -> float:
    """DeepNorm's init gain for the MLP and the attention value and output projections: (8N)^(-1/4)."""
    return (8 * depth) ** -0.25


def mix_post_blocks(depth: int, p: float) -> int:
    """Mix-LN's number of leading post-norm blocks, ⌊p·depth⌋ (tolerant of float error such as 0.29·100)."""
    return math.floor(p * depth + 1e-9)


def block_slots(placement: str, layer: int, depth: int, mix_p: float = 0.25) -> Slots:
    """The slots that `placement` fills in block `layer` (0-based) of a `depth`-block model."""
    if placement not in PLACEMENT_TRAITS:
        raise ValueError(f"unknown placement {placement!r}")
    traits = PLACEMENT_TRAITS[placement]
    if traits.leading is not None and layer < mix_post_blocks(depth, mix_p):
        traits = PLACEMENT_TRAITS[traits.leading]
    alpha = deepnorm_alpha(depth) if traits.deepnorm else 1.0
    pre_scale = 1 / math.sqrt(layer + 1) if traits.depth_scale else 1.0
    return Slots(pre="pre" in traits.slots, post="post" in traits.slots, alpha=alpha, branch="branch" in traits.slots,
                 pre_scale=pre_scale)


def has_final_norm(placement: str, depth: int = 1, mix_p: float = 0.25) -> bool:
    """A residual stream the last block leaves unnormalized needs a norm before the head.

    True for pre, sandwich, reordered, lns and mix with a pre-norm last block; False for post and deepnorm.
    """
    return not block_slots(placement, depth - 1, depth, mix_p).post


def uses_final_norm(cfg: RunConfig) -> bool:
    """Whether the model has a norm before the head: final_norm, or with final_norm=auto the placement's default."""
    if cfg.final_norm == AUTO_FINAL_NORM:
        return has_final_norm(cfg.placement, cfg.depth, cfg.mix_p)
    return bool(cfg.final_norm)


def gate_init(cfg: RunConfig) -> float:
    """The residual gate's initial value: residual_gate_init, or the method's own: ReZero's 0
    (Bachlechner et al. 2020), LayerScale's by depth, 0.1 up to 18 blocks, 1e-5 up to 24, 1e-6 beyond
    (Touvron et al. 2021, CaiT)."""
    if cfg.residual_gate_init is not None:
        return cfg.residual_gate_init
    if cfg.residual_gate == "rezero":
        return 0.0
    return 0.1 if cfg.depth <= 18 else 1e-5 if cfg.depth <= 24 else 1e-6


class ResidualGate(nn.Module):
    """The a of x + a ⊙ f(·): one learnable scalar (ReZero) or one per feature (LayerScale)."""

    def __init__(self, shape: tuple[int, ...], init: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, float(init)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


def build_gate(cfg: RunConfig) -> nn.Module:
    if cfg.residual_gate == "none":
        return nn.Identity()
    shape = () if cfg.residual_gate == "rezero" else (cfg.model.d_model,)
    return ResidualGate(shape, gate_init(cfg))


def read_by_batch_norms(cfg: RunConfig, slots: list[Slots]) -> list[bool]:
    """For the residual stream entering block i (i = depth: leaving the last block), whether a training-mode
    BatchNorm's mean subtraction stands on every path from it to the loss: so any shift added to it cancels.

    That holds for the stream entering a block that reads it through its pre-slot norms alone, if it holds
    for the stream leaving that block; the stream leaving the last block, if a final norm reads it.
    """
    centered = [NORM_TRAITS[cfg.norm.name].batch_statistics and uses_final_norm(cfg)]
    for block in reversed(slots):
        centered.insert(0, block.pre and not block.post and centered[0])
    return centered


def cancelled_shifts(cfg: RunConfig, slots: Slots, centered_after: bool) -> frozenset[str]:
    """The modules of a block whose shift (a linear layer's bias, a norm's β) a BatchNorm subtracts again.

    A per-feature constant added before a training-mode BatchNorm cancels in its output, so its gradient
    is zero up to rounding, and AdamW turns that rounding noise into lr-sized updates: such shifts are not
    built. The sublayers' output shifts (the output projections' biases, and the attention's value and
    key biases: CausalSelfAttention's `shift_free`) cancel when the sublayer's output reaches the loss only
    through a BatchNorm: the branch norm, the post norm, or a stream read only by BatchNorms
    (`centered_after`: the stream leaving this block, see read_by_batch_norms); the branch norms' β when
    the post norm or such a stream follows; the second post norm's β (its output is the block's) when
    such a stream follows.
    """
    if not NORM_TRAITS[cfg.norm.name].batch_statistics:
        return frozenset()
    cancelled = set()
    if slots.branch or slots.post or centered_after:
        cancelled |= {"attn", "mlp"}
    if slots.branch and (slots.post or centered_after):
        cancelled |= {"norm1_out", "norm2_out"}
    if slots.post and centered_after:
        cancelled.add("norm2")
    return frozenset(cancelled)


class Block(nn.Module):
    def __init__(self, cfg: RunConfig, slots: Slots, centered_after: bool = False):
        super().__init__()
        d, positions = cfg.model.d_model, cfg.model.context
        self.slots = slots
        cancelled = cancelled_shifts(cfg, slots, centered_after)

        def slot_norm(name: str, filled: bool, role: str) -> nn.Module:
            norm_cfg = replace(cfg.norm, bias=False) if name in cancelled else cfg.norm
            return build_norm(norm_cfg, d, role, positions) if filled else nn.Identity()

        self.norm1 = slot_norm("norm1", slots.pre or slots.post, "attn")
        self.attn = CausalSelfAttention(cfg, shift_free="attn" in cancelled)
        self.norm1_out = slot_norm("norm1_out", slots.branch, "attn")
        self.gate1 = build_gate(cfg)
        self.norm2 = slot_norm("norm2", slots.pre or slots.post, "mlp")
        self.mlp = MLP(d, cfg.model.mlp_ratio, cfg.model.bias, shift_free="mlp" in cancelled)
        self.norm2_out = slot_norm("norm2_out", slots.branch, "mlp")
        self.gate2 = build_gate(cfg)
        self.gated = cfg.residual_gate != "none"

    def forward(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        """Per sublayer f (attention, then MLP), with unfilled slots the identity:

        x ──┬─► [norm, pre slot] × s ─► f ─► [norm_out, branch slot] ─► gate ─► (+) ─► [norm, post slot] ─► x'
            └─────────────────────────────── α · x ─────────────────────────────┘

        `tap` (normlab.nn.tap) sees the stream in and out, the filled norm slots and the sublayers' outputs.
        """
        if tap is not None:
            x = tap("in", x)
        x = self._sublayer(x, self.norm1, self.attn, self.norm1_out, self.gate1, tap, "1")
        x = self._sublayer(x, self.norm2, self.mlp, self.norm2_out, self.gate2, tap, "2")
        return x if tap is None else tap("out", x)

    def _sublayer(self, x: torch.Tensor, norm: nn.Module, f: nn.Module, norm_out: nn.Module,
                  gate: nn.Module, tap: Tap | None = None, n: str = "1") -> torch.Tensor:
        if tap is None:
            h = norm_out(f(self._pre(norm, x)))
        else:  # the same computation, shown to the tap; slot names as the module's (norm1, attn, norm1_out)
            h = f(self._pre(norm, x, tap, f"norm{n}"), tap)
            h = tapped(norm_out, f"norm{n}_out", tap(f"{'attn' if n == '1' else 'mlp'}.out", h), tap)
        if self.gated:  # an identity gate is not called: the default block's step costs what it did
            h = gate(h)
        x = x + h if self.slots.alpha == 1.0 else self.slots.alpha * x + h
        if not self.slots.post:
            return x
        return norm(x) if tap is None else tapped(norm, f"norm{n}", x, tap)

    def _pre(self, norm: nn.Module, x: torch.Tensor, tap: Tap | None = None, name: str = "") -> torch.Tensor:
        if not self.slots.pre:
            return x
        y = norm(x) if tap is None else tapped(norm, name, x, tap)
        return y if self.slots.pre_scale == 1.0 else y * self.slots.pre_scale


class GPT(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        m = cfg.model
        self.context = m.context
        # The original Transformer's embedding scale: token embeddings × sqrt(d) on the way in (the
        # tied head reads the unscaled matrix), so the stream starts at the size of the sublayers' outputs.
        self.embed_scale = math.sqrt(m.d_model) if m.embed_scale else 1.0
        vocab = m.vocab_size if m.vocab_size is not None else tokenizer_vocab(cfg)
        if vocab is None:  # tokenizer=hf: train() resolves it from the loaded tokenizer (with_model_vocab)
            raise ValueError("model.vocab_size is null and tokenizer=hf's vocabulary is known only once it loads: set it")
        self.tok_emb = nn.Embedding(vocab, m.d_model)
        self.pos_emb = nn.Embedding(m.context, m.d_model)
        slots = [block_slots(cfg.placement, i, cfg.depth, cfg.mix_p) for i in range(cfg.depth)]
        centered = read_by_batch_norms(cfg, slots)
        self.norm_embed = build_embed_norm(cfg, shift=not centered[0]) if cfg.embed_norm else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg, s, centered[i + 1]) for i, s in enumerate(slots))
        self.norm_f = build_norm(cfg.norm, m.d_model, "final", m.context) if uses_final_norm(cfg) else nn.Identity()
        self.head = nn.Linear(m.d_model, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied output head
        beta = deepnorm_beta(cfg.depth) if PLACEMENT_TRAITS[cfg.placement].deepnorm else 1.0
        init_weights(self, cfg.init, cfg.depth, beta)

    def forward(self, idx: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        """Logits of shape (B, T, vocab) for token ids `idx` of shape (B, T); `tap` (normlab.nn.tap) sees
        the embedding, every block's tensors, the final norm and the logits."""
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"sequence of length {T} exceeds the model's context {self.context}")
        pos = torch.arange(T, device=idx.device)
        tok = self.tok_emb(idx)
        x = (tok if self.embed_scale == 1.0 else tok * self.embed_scale) + self.pos_emb(pos)
        if tap is None:
            if not isinstance(self.norm_embed, nn.Identity):
                x = self.norm_embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm_f(x))
        x = tapped(self.norm_embed, "norm_embed", tap("embed", x), tap)
        for i, block in enumerate(self.blocks):
            x = block(x, tap.block(i))
        return tap("logits", self.head(tapped(self.norm_f, "norm_f", x, tap)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_embed_norm(cfg: RunConfig, shift: bool) -> nn.Module:
    """embed_norm=true's norm on token + position embedding, with DyT's and Derf's attention α₀; without its
    shift β where a BatchNorm downstream subtracts it again (`shift` False: see cancelled_shifts)."""
    norm_cfg = cfg.norm if shift else replace(cfg.norm, bias=False)
    return build_norm(norm_cfg, cfg.model.d_model, "attn", cfg.model.context)


def init_weights(model: GPT, scheme: str, depth: int, beta: float = 1.0) -> None:
    """`normal`: GPT-2's N(0, 0.02), residual output projections scaled by 1/sqrt(2·depth).
    `xavier`: Xavier-uniform linear weights and zero biases (Xiong et al. 2020), embeddings N(0, d^-1/2).

    `beta` then multiplies the weights of the MLP (fc, proj) and of the attention value
    and output projections (the v rows of the fused qkv, and proj), not queries or keys:
    DeepNorm's β on top of either scheme, so deepnorm differs from post by α and β alone.
    """
    d = model.tok_emb.embedding_dim
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if module is model.head:
                continue  # tied to the token embedding
            if scheme == "normal":
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif name.endswith("attn.qkv"):
                for w in module.weight.chunk(3, dim=0):  # Xavier per projection, as for separate q, k, v
                    nn.init.xavier_uniform_(w)
            else:
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            std = 0.02 if scheme == "normal" else d**-0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
    if beta != 1.0:
        with torch.no_grad():
            for block in model.blocks:
                C = block.attn.proj.in_features
                block.attn.qkv.weight[2 * C :].mul_(beta)  # the value rows of [q; k; v]
                for linear in (block.attn.proj, block.mlp.fc, block.mlp.proj):
                    linear.weight.mul_(beta)
