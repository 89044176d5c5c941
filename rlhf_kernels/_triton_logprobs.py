r"""Triton kernels for per-token log-probs and entropy, one read of the logits forward,
one read + one write backward.

Notation (per row; x = logits row of length V, T = temperature, y = target token)::

    z_i = x_i / T                        p_i = exp(z_i - lse)
    lse = log sum_i exp(z_i)             logp_y = z_y - lse
    H   = -sum_i p_i log p_i = lse - sum_i p_i z_i

Forward (``_fwd_kernel``): one pass over V in blocks of BLOCK columns with an online
log-sum-exp. Running state after a prefix: m (max so far), s = sum exp(z_i - m),
t = sum exp(z_i - m) (z_i - m). When a block raises the max to m' the old state is rebased:
with a = exp(m - m')::

    s' = a s + sum_blk e_i                      e_i = exp(z_i - m')
    t' = a (t + s (m - m')) + sum_blk e_i (z_i - m')

(because e^{z-m'} (z - m') = a e^{z-m} ((z - m) + (m - m'))). At the end
lse = m + log s, logp_y = (z_y - m) - log s and H = log s - t / s  (= lse - E_p[z], computed relative to m so a
peaked row does not subtract two large numbers). Columns >= V load -inf, so e_i = 0;
the products e_i (z_i - m') are taken as 0 whenever z_i = -inf (avoids 0 * -inf = nan).
The target logit is a single scalar load at column y.

Backward (``_bwd_kernel``), with upstream grads g_lp = dL/dlogp_y and g_H = dL/dH::

    dlogp_y / dz_i = [i == y] - p_i
    dH / dz_i      = -sum_j (dp_j/dz_i)(log p_j + 1)        dp_j/dz_i = p_j([i == j] - p_i)
                   = -p_i (log p_i + 1) + p_i sum_j p_j (log p_j + 1)
                   = -p_i (log p_i + H)
    dL / dx_i      = (1/T) [ g_lp ([i == y] - p_i) - g_H p_i (log p_i + H) ]
                   = -p_i (g_lp' + g_H' (log p_i + H)) + [i == y] g_lp'      g' = g / T

which is ``g = -p * (g_lp + g_h * (logp_i + ent))`` in the code (g_lp, g_h already times 1/T),
set to 0 where p == 0 (this covers -inf logits, whose limit p log p -> 0). The target column
is computed once per row, in fp32, as::

    c_y = g_lp' (1 - p_y) - g_H' p_y (logp_y + H),   1 - p_y = -expm1(logp_y)

with a short series for -expm1 when logp_y is near 0 (p_y -> 1 would otherwise cancel), and is
placed with ``tl.where(cols == y, c_y, g)`` before the single cast at the store.

Rows: program id r -> (b, s) = (r // S, r % S); element (b, s, i) lives at
b * stride_b + s * stride_s + i, computed in int64 (16k x 152k > 2^31). V is a runtime
argument; BLOCK is the only compile-time size. Masked rows skip the loads and write zeros.
"""

import torch
import triton
import triton.language as tl

from ._common import prepare_tokens_mask, rows_view, run_backward, save_and_return


@triton.jit
def _fwd_kernel(
    x_ptr,
    y_ptr,
    mask_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    S,
    stride_b,
    stride_s,
    V,
    inv_t,
    HAS_MASK: tl.constexpr,
    WANT_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s_idx = row - b * S
    base = x_ptr + b * stride_b + s_idx * stride_s
    if HAS_MASK:
        valid = tl.load(mask_ptr + row) != 0
    else:
        valid = row >= 0
    n_cols = tl.where(valid, V, 0)  # masked rows: no loads at all

    neg_inf = float("-inf")
    m = tl.max(tl.full([BLOCK], neg_inf, tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    t = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=neg_inf).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new == neg_inf, 0.0, m_new)  # all -inf so far: any finite reference
        a = tl.exp(m - m_ref)
        d = z - m_ref
        e = tl.exp(d)
        if WANT_ENT:
            t_old = tl.where(s > 0, t + s * (m - m_ref), 0.0)
            t = a * t_old + tl.sum(tl.where(z > neg_inf, e * d, 0.0), axis=0)
        s = a * s + tl.sum(e, axis=0)
        m = m_new

    y = tl.load(y_ptr + row)
    z_y = tl.load(base + y, mask=valid, other=0.0).to(tl.float32) * inv_t
    log_s = tl.log(s)
    lse = m + log_s
    logp = (z_y - m) - log_s  # not z_y - lse: adding log s (~1e-7 for a peaked row) to m would round it away
    tl.store(logp_ptr + row, tl.where(valid, logp, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    if WANT_ENT:
        tl.store(ent_ptr + row, tl.where(valid, log_s - t / s, 0.0))


@triton.jit
def _bwd_kernel(
    x_ptr,
    gx_ptr,
    y_ptr,
    mask_ptr,
    lse_ptr,
    ent_ptr,
    logp_ptr,
    glp_ptr,
    gh_ptr,
    S,
    sx_b,
    sx_s,
    sg_b,
    sg_s,
    V,
    inv_t,
    HAS_MASK: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s_idx = row - b * S
    xb = x_ptr + b * sx_b + s_idx * sx_s
    gb = gx_ptr + b * sg_b + s_idx * sg_s
    if HAS_MASK:
        valid = tl.load(mask_ptr + row) != 0
    else:
        valid = row >= 0

    n_cols = tl.where(valid, V, 0)  # masked rows: no loads, zeros stored
    lse = tl.load(lse_ptr + row)
    logp_y = tl.load(logp_ptr + row)
    y = tl.load(y_ptr + row)
    if HAS_GLP:
        g_lp = tl.where(valid, tl.load(glp_ptr + row) * inv_t, 0.0)
    else:
        g_lp = 0.0
    p_y = tl.exp(logp_y)
    # 1 - p_y = -expm1(logp_y); series when |logp_y| < 0.1 (truncation error < x^5/720)
    u = logp_y
    om_series = -u * (1.0 + u * (0.5 + u * (1.0 / 6.0 + u * (1.0 / 24.0 + u * (1.0 / 120.0)))))
    one_minus_py = tl.where(u > -0.1, om_series, 1.0 - p_y)
    c_y = g_lp * one_minus_py
    if HAS_GH:
        ent = tl.load(ent_ptr + row)
        g_h = tl.where(valid, tl.load(gh_ptr + row) * inv_t, 0.0)
        c_y = c_y - g_h * p_y * (logp_y + ent)

    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cmask = cols < V
        x = tl.load(xb + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        logp_i = x * inv_t - lse
        p = tl.exp(logp_i)
        if HAS_GH:
            g = tl.where(p > 0, -p * (g_lp + g_h * (logp_i + ent)), 0.0)
        else:
            g = -p * g_lp
        g = tl.where(cols == y, c_y, g)
        tl.store(gb + cols, g.to(gx_ptr.dtype.element_ty), mask=cmask)


def _block_and_warps(V: int, block=None):
    if block is None:
        block = min(4096, triton.next_power_of_2(max(V, 16)))
    warps = 4 if block <= 1024 else 8
    return block, warps


def _fill_grad(x3, grad3, saved, cfg, g_lp, g_h):
    """Write dL/dlogits into ``grad3`` with one ``_bwd_kernel`` launch (the Triton part of ``run_backward``)."""
    _, tok, msk_i, lse, ent, logp = saved
    inv_t, _, inplace, block = cfg
    Bn, Sn, V = x3.shape
    N = Bn * Sn
    g_lp = g_lp.reshape(N).to(torch.float32).contiguous() if g_lp is not None else None
    g_h = g_h.reshape(N).to(torch.float32).contiguous() if g_h is not None else None
    BLOCK, warps = _block_and_warps(V, block)
    if N > 0:
        _bwd_kernel[(N,)](
            x3,
            grad3,
            tok,
            msk_i if msk_i is not None else tok,
            lse,
            ent if ent is not None else lse,
            logp,
            g_lp if g_lp is not None else lse,
            g_h if g_h is not None else lse,
            Sn,
            x3.stride(0),
            x3.stride(1),
            grad3.stride(0),
            grad3.stride(1),
            V,
            inv_t,
            HAS_MASK=msk_i is not None,
            HAS_GLP=g_lp is not None,
            HAS_GH=g_h is not None,
            BLOCK=BLOCK,
            num_warps=warps,
        )
    if inplace:
        torch.autograd.graph.increment_version(x3)  # the kernel wrote behind autograd's back


class TritonTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, mask, temperature, want_entropy, inplace_backward, block):
        x3, copied = rows_view(logits)
        Bn, Sn, V = x3.shape
        N = Bn * Sn
        tok, msk = prepare_tokens_mask(tokens, mask, Bn, Sn)
        tok = tok.contiguous()
        msk_i = msk.to(torch.int8).contiguous() if msk is not None else None
        inv_t = 1.0 / float(temperature)
        f32 = dict(dtype=torch.float32, device=logits.device)
        logp = torch.empty(N, **f32)
        lse = torch.empty(N, **f32)
        ent = torch.empty(N, **f32) if want_entropy else None
        BLOCK, warps = _block_and_warps(V, block)
        if N > 0:
            _fwd_kernel[(N,)](
                x3,
                tok,
                msk_i if msk_i is not None else tok,
                logp,
                ent if ent is not None else logp,
                lse,
                Sn,
                x3.stride(0),
                x3.stride(1),
                V,
                inv_t,
                HAS_MASK=msk_i is not None,
                WANT_ENT=want_entropy,
                BLOCK=BLOCK,
                num_warps=warps,
            )
        saved = (logits, tok, msk_i, lse, ent, logp)
        return save_and_return(ctx, saved, (inv_t, want_entropy, inplace_backward, block))

    @staticmethod
    def backward(ctx, *grads):
        return run_backward(ctx, grads, _fill_grad)
