"""Multi-head latent attention (DeepSeek-V2/V3 MLA) conditioned through its low-rank factors, on request.

An MLA layer has no per-head ``W_Q``, ``W_K``, ``W_V`` parameters: each head's query is
``q_b_proj`` (head ``h``'s rows) after an RMSNorm of the latent ``q_a_proj(x)``, its keys and values
are ``kv_b_proj`` (head ``h``'s key rows, then its value rows) after an RMSNorm of the KV latent
(the first ``kv_lora_rank`` outputs of ``kv_a_proj_with_mqa``), and every head's key ends in the
same RoPE key (the last ``qk_rope_head_dim`` outputs of ``kv_a_proj_with_mqa``, no norm). Without
the query LoRA (``q_lora_rank=None``) the query is ``q_proj(x)``.

With ``mla="factors"`` the factors are written so that each head's map from the input is a
per-token scalar times a semi-orthogonal matrix (:mod:`condinit.init.factors` says what is written;
``docs/design.md``, "Multi-head latent attention", the math): the down projections orthonormal rows
(the KV latent's: the rectangular identity), each head's up blocks orthonormal rows, the RoPE key a
key head of its own, V a coordinate selection (the rectangular identity where ``H d_v <= r_kv``).
It is an extension of the method, not the method: the latent RMSNorm makes each map semi-orthogonal
only up to a per-token scale (``1 / rms`` of the latent), V cannot be the rectangular identity over
``[H d_v, D]`` once ``H d_v > kv_lora_rank`` (the stacked V has rank at most ``kv_lora_rank``), and
all heads read one ``r``-dimensional latent. So it is opt-in (:func:`latent_attention`,
``condinit.apply(model, mla="factors")``); otherwise the adapter hands the module on (None) and
structural discovery refuses it with a one-line reason saying how to opt in.

The description (:class:`LatentAttentionSpec`) is an :class:`~condinit.models.spec.AttentionSpec`
whose ``q`` / ``k`` / ``v`` are the up projections' rows (``q_b_proj``; ``kv_b_proj``'s key and value
rows per head) and which also holds the down projections (``q_a``, ``kv_a``), so every tensor the
layer writes is one of its :meth:`~LatentAttentionSpec.projections`; :meth:`~LatentAttentionSpec.plan_into`
lists its writes (:func:`condinit.init.factors.plan_latent`).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from condinit._validate import check_choice
from condinit.init.factors import LatentShape, latent_problem, plan_latent
from condinit.models.registry import register_adapter
from condinit.models.sharded import is_dtensor
from condinit.models.spec import (AttentionDetails, AttentionSpec, Projection, Ref, UnsupportedAttention,
                                  tensor_places)

__all__ = ["MLA_MODES", "MLA_CLASSES", "LatentAttentionSpec", "latent_attention", "mla_mode"]

MLA_MODES = ("refuse", "factors")
_MODE: contextvars.ContextVar = contextvars.ContextVar("condinit_mla", default="refuse")

# Classes whose forward reads the factors as the module doc says: transformers' DeepseekV2/V3Attention
# and the copies of DeepseekV3Attention (GLM-4-MoE-Lite, Youtu).
MLA_CLASSES = ("transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention",
               "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention",
               "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteAttention",
               "transformers.models.youtu.modeling_youtu.YoutuAttention")


@contextlib.contextmanager
def latent_attention(mode: str = "factors"):
    """Within the block, :func:`condinit.models.describe` describes multi-head latent attention by
    its factors (``mode="factors"``) or refuses it (``"refuse"``, the default outside any block).

    Examples:
        >>> with latent_attention("factors"):
        ...     found = condinit.models.discover(model)
    """
    token = _MODE.set(check_choice("mla", mode, MLA_MODES))
    try:
        yield
    finally:
        _MODE.reset(token)


def mla_mode() -> str:
    """The mode :func:`latent_attention` set (``"refuse"`` outside any block)."""
    return _MODE.get()


@dataclass(frozen=True, kw_only=True)
class LatentAttentionSpec(AttentionSpec):
    """A multi-head latent attention layer: ``q`` is the query's up projection (``q_b_proj``, or
    ``q_proj`` without the query LoRA; ``num_heads`` blocks of ``head_dim = nope_dim + rope_dim``
    rows), ``k`` / ``v`` the key / value rows of ``kv_b_proj`` (``num_heads`` groups of ``nope_dim``
    / ``v_dim`` rows), ``kv_a`` all of ``kv_a_proj_with_mqa`` (the KV latent's ``kv_rank`` rows,
    then the RoPE key's ``rope_dim``), ``q_a`` the query's down projection (None without the LoRA).
    The reading assumes the latent RMSNorms' weights constant (ones, as the model initializes them):
    the adapter refuses a module whose norm weights hold other values."""

    kv_a: Projection
    q_a: Optional[Projection] = None
    nope_dim: int
    rope_dim: int
    v_dim: int

    def __post_init__(self):
        H, dn, dr, dv = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        if self.num_kv_heads != H or self.head_dim != dn + dr:
            raise ValueError(f"LatentAttentionSpec: num_kv_heads {self.num_kv_heads} and head_dim {self.head_dim}, "
                             f"expected num_heads {H} and nope_dim + rope_dim {dn + dr}")
        if self.q.rows != H * (dn + dr) or self.k.rows != H * dn or self.v.rows != H * dv:
            raise ValueError(f"LatentAttentionSpec: q, k, v rows {self.q.rows}, {self.k.rows}, {self.v.rows}, "
                             f"expected {H * (dn + dr)}, {H * dn}, {H * dv}")
        if self.k.weight is not self.v.weight:
            raise ValueError("LatentAttentionSpec: k and v must be rows of one kv_b weight")
        problem = latent_problem(self.shape)
        if problem is not None:
            raise UnsupportedAttention(f"multi-head latent attention: {problem}")

    @property
    def shape(self) -> LatentShape:
        q_rank = None if self.q_a is None else self.q_a.rows
        return LatentShape(self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, q_rank,
                           self.kv_a.rows - self.rope_dim, self.kv_a.in_features)

    def projections(self):
        extra = (("kv_a", self.kv_a),) if self.q_a is None else (("q_a", self.q_a), ("kv_a", self.kv_a))
        return super().projections() + extra

    @property
    def layout(self) -> str:
        return "latent"

    def v_identity_problem(self, v_mode: str, raise_it: bool = False) -> Optional[str]:
        return None     # both V modes are written into kv_b's value rows (see condinit.init.factors)

    @property
    def is_bound(self) -> bool:
        return all(isinstance(p.weight_source, Ref) and (p.bias_source is None or isinstance(p.bias_source, Ref))
                   for _, p in self.projections())

    def bound_to(self, module: nn.Module, details: Optional[AttentionDetails] = None) -> "LatentAttentionSpec":
        places = tensor_places(module)
        return LatentAttentionSpec(
            q=self.q.bound(places), k=self.k.bound(places), v=self.v.bound(places), num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            details=self.details if details is None else details, kv_a=self.kv_a.bound(places),
            q_a=None if self.q_a is None else self.q_a.bound(places), nope_dim=self.nope_dim,
            rope_dim=self.rope_dim, v_dim=self.v_dim)

    def plan_into(self, plan, layer_index: int, owner, *, v_mode: str, qk_gain: float, v_gain: float) -> None:
        """Add this layer's writes (:func:`condinit.init.factors.plan_latent`) to ``plan``."""
        for name, p in self.projections():
            if is_dtensor(p.weight):
                raise ValueError(f"multi-head latent attention with a sharded (DTensor) {name} weight: its factors "
                                 f"are conditioned on whole tensors only")
        biases = [p.bias.detach() for p in (self.q_a, self.kv_a) if p is not None and p.bias is not None]
        plan_latent(plan, self.shape, q_b=self.q.matrix(), kv_a=self.kv_a.matrix(), kv_b=self.k.matrix(),
                    q_a=None if self.q_a is None else self.q_a.matrix(), biases=biases, layer=layer_index,
                    v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain, owner=owner)

    def effective_stats(self) -> dict:
        """``{"q", "k", "v"}``: the singular values of each head's map from the input, the norm's
        per-token scale left out (:class:`condinit.models.BlockStats`; ``k`` holds the ``H``
        no-RoPE key heads, then the RoPE key). Each head's map is the product ``B_h A`` of its up
        block and the down factor; its singular values are the square roots of the eigenvalues of
        ``B_h (A A^T) B_h^T`` (float64), so no ``[d, D]`` product is formed."""
        from condinit.models.report import BlockStats

        s = self.shape
        kv = self.kv_a.view().double()
        latent = kv[:s.kv_rank]
        gram_kv = latent @ latent.t()
        if self.q_a is None:
            q_stats = _stats(self.q.view().double().reshape(s.num_heads, s.qk_dim, -1), None)
        else:
            qa = self.q_a.view().double()
            q_stats = _stats(self.q.view().double().reshape(s.num_heads, s.qk_dim, -1), qa @ qa.t())
        k_up = self.k.view().double().reshape(s.num_heads, s.nope_dim, s.kv_rank)
        k_nope = _stats(k_up, gram_kv)
        k_rope = _stats(kv[s.kv_rank:][None], None)
        v_stats = _stats(self.v.view().double().reshape(s.num_heads, s.v_dim, s.kv_rank), gram_kv)
        k_stats = tuple(torch.cat(pair) for pair in zip(k_nope, k_rope))
        return {"q": BlockStats.from_heads(*q_stats), "k": BlockStats.from_heads(*k_stats),
                "v": BlockStats.from_heads(*v_stats)}


def _stats(up: torch.Tensor, gram: Optional[torch.Tensor]):
    """``(sigma_max, sigma_min, cond)`` per block of ``up @ A`` with ``gram = A A^T`` (``up`` itself
    when ``gram`` is None). A block has no more rows than ``A`` (:func:`condinit.init.factors.latent_problem`),
    nor ``A`` than columns, so all its ``rows`` singular values count."""
    if gram is None:
        from condinit.init.spectrum import spectrum

        return tuple(t.double() for t in spectrum(up))
    sigma = torch.linalg.eigvalsh(up @ gram @ up.transpose(1, 2)).clamp_min(0).sqrt()
    smax, smin = sigma[:, -1], sigma[:, 0]
    return smax, smin, smax / smin


def _spec(m: nn.Module) -> LatentAttentionSpec:
    """transformers' ``DeepseekV2Attention`` / ``DeepseekV3Attention`` and its copies (their ``forward`` and
    ``expand_kv``): ``q_b_proj(q_a_layernorm(q_a_proj(x))).view(..., H, d_n + d_r)`` split
    ``[d_n, d_r]``; ``kv_a_proj_with_mqa(x)`` split ``[r_kv, d_r]``, the first part through
    ``kv_a_layernorm``, then ``kv_b_proj(...).view(..., H, d_n + d_v)`` split ``[d_n, d_v]``; the
    RoPE part is expanded to every head."""
    if mla_mode() != "factors":
        return None     # not asked for: structure refuses the module, saying how to opt in
    H, dn, dr, dv = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    lora = m.q_lora_rank is not None
    q_up = m.q_b_proj if lora else m.q_proj
    kv_b = m.kv_b_proj.weight
    norms = (m.q_a_layernorm, m.kv_a_layernorm) if lora else (m.kv_a_layernorm,)
    for norm in norms:
        w = norm.weight
        if not w.is_meta and not is_dtensor(w) and w.numel() and not bool((w == w.reshape(-1)[0]).all()):
            raise UnsupportedAttention("multi-head latent attention whose latent RMSNorm weight is not constant: the "
                                       "factors' product is semi-orthogonal only through a constant norm weight "
                                       "(ones, as the model initializes it)")
    if q_up.bias is not None or m.kv_b_proj.bias is not None:
        raise UnsupportedAttention("multi-head latent attention with biased up projections: not the layout of "
                                   "transformers' DeepseekV3Attention")
    a = m.kv_a_proj_with_mqa
    return LatentAttentionSpec(
        q=Projection(q_up.weight, 0, q_up.weight.shape[0]),
        k=Projection(kv_b, 0, dn, groups=H, stride=dn + dv),
        v=Projection(kv_b, dn, dn + dv, groups=H, stride=dn + dv),
        num_heads=H, num_kv_heads=H, head_dim=dn + dr,
        kv_a=Projection(a.weight, 0, a.weight.shape[0], bias=a.bias),
        q_a=Projection(m.q_a_proj.weight, 0, m.q_a_proj.weight.shape[0], bias=m.q_a_proj.bias) if lora else None,
        nope_dim=dn, rope_dim=dr, v_dim=dv)


for _path in MLA_CLASSES:
    register_adapter(_path, _spec, name=f"hf.{_path.rsplit('.', 1)[1]}")
