"""Shared ``@triton.jit`` helpers of the attention kernels: row loads, product operands, sequence
lengths, the tile ranges a program visits and the allowed (query, key) pairs of a tile.

The masks are those of docs/design.md ("Attention", "Masks"). The host folds them into two offsets
(:func:`condinit.kernels.attention.host.mask_args`): key ``j`` is allowed for query ``i`` iff
``i < Lq``, ``j < Lk`` and ``i + off - win_left <= j <= i + off + win_right``; each program
(:func:`tile_range`) visits only the tiles that meet an allowed pair: unmasked where every pair of
the tile is allowed, masked around them. A sliding window of ``W`` keys costs ``O(N W)``. Masked
tiles read rows past ``Lq`` / ``Lk`` as 0, so padded positions never reach a product even if they
hold NaN. A NaN in a *valid* key or value that the window or causal mask hides from a row can
still reach that row through a tile product (``0 x NaN``) when another row of the same tile
attends it, as in every tiled kernel.
"""
import triton
import triton.language as tl


@triton.jit
def load_rows(ptrs, rows, n_rows, cols, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr,
               EVEN_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; rows >= n_rows and columns >= HEAD_DIM read as 0."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def dot_operand(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """``x`` rounded to the input dtype, as an operand of ``tl.dot``. The interpreter has no
    bf16/fp16 arithmetic, so there the rounded value is upcast to fp32 again (same rounding as
    the GPU, products in fp32)."""
    y = x.to(DTYPE)
    if INTERPRETER:
        y = y.to(tl.float32)
    return y


@triton.jit
def seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS: tl.constexpr):
    """(Lq, Lk) of batch ``off_b``: the given lengths clamped to [0, N] (so that no load leaves
    the tensors whatever they hold), or the full lengths."""
    if HAS_LENS:
        len_q = tl.minimum(tl.maximum(tl.load(QLens + off_b), 0), n_q)
        len_k = tl.minimum(tl.maximum(tl.load(KLens + off_b), 0), n_k)
    else:
        len_q = n_q
        len_k = n_k
    return len_q, len_k


@triton.jit
def tile_range(start, n_own, len_own, len_other, lo_off, hi_off,
                BLOCK_OWN: tl.constexpr, BLOCK_OTHER: tl.constexpr):
    """The tiles of the other axis that the own tile ``[start, start + BLOCK_OWN)`` meets, where
    other index ``o`` is allowed for own index ``x`` iff ``x < len_own``, ``o < len_other`` and
    ``x + lo_off <= o <= x + hi_off`` (own = queries: the mask of the module docstring; own =
    keys: the same mask seen from a key, offsets negated and swapped).

    Returns ``(lo, n_masked, n_left, gap, full_lo, n_full)``: ``n_full`` unmasked tiles (every
    pair allowed, every index in bounds) start at ``full_lo + t * BLOCK_OTHER``; the ``n_masked``
    masked tiles around them at ``lo + t * BLOCK_OTHER``, plus ``gap`` (the unmasked span) once
    ``t >= n_left``. Tiles that meet no allowed pair are not visited at all, so a sliding window
    costs O(N W), not O(N^2)."""
    end = tl.minimum(start + BLOCK_OWN, len_own)
    lo = (tl.maximum(start + lo_off, 0) // BLOCK_OTHER) * BLOCK_OTHER
    hi = tl.minimum(end + hi_off, len_other)
    hi = tl.where(end > start, tl.maximum(hi, lo), lo)
    full_lo = tl.cdiv(tl.maximum(start + BLOCK_OWN - 1 + lo_off, 0), BLOCK_OTHER) * BLOCK_OTHER
    full_hi = (tl.maximum(tl.minimum(start + hi_off + 1, len_other), 0) // BLOCK_OTHER) * BLOCK_OTHER
    # Unmasked tiles need every own index of the tile valid; indices past the tensor (when the
    # lengths are the tensor's) are never stored, so they need no mask.
    whole = (start + BLOCK_OWN <= len_own) | (len_own == n_own)
    full_lo = tl.where(whole, tl.minimum(tl.maximum(full_lo, lo), hi), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    n_left = tl.cdiv(full_lo - lo, BLOCK_OTHER)
    n_masked = n_left + tl.cdiv(hi - full_hi, BLOCK_OTHER)
    return lo, n_masked, n_left, full_hi - full_lo, full_lo, (full_hi - full_lo) // BLOCK_OTHER


@triton.jit
def tile_start(base, t, n_left, gap, BLOCK: tl.constexpr):
    """Start of tile ``t`` of a loop from :func:`tile_range` (a multiple of BLOCK)."""
    return tl.multiple_of(base + t * BLOCK + tl.where(t >= n_left, gap, 0), BLOCK)


@triton.jit
def allowed_pairs(rows, cols, len_q, len_k, lo_off, hi_off):
    """[rows, cols]: query ``i`` may attend key ``j``."""
    i = rows[:, None]
    j = cols[None, :]
    return (i < len_q) & (j < len_k) & (j >= i + lo_off) & (j <= i + hi_off)


@triton.jit
def allowed_pairs_t(cols, rows, len_q, len_k, lo_off, hi_off):
    """[cols, rows]: :func:`allowed_pairs` transposed (the key-tile programs)."""
    j = cols[:, None]
    i = rows[None, :]
    return (i < len_q) & (j < len_k) & (j >= i + lo_off) & (j <= i + hi_off)

