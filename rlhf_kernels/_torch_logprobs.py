"""Chunked torch implementation of per-token log-probs / entropy (the CPU path).

Rows are processed in chunks so that only two ``(rows, V)`` fp32 scratch buffers ever exist
(sized by ``CHUNK_BYTES``); the full fp32 ``(N, V)`` log-softmax is never materialised. The
forward saves only the per-row statistics (lse, entropy, logp) besides the logits and tokens,
and the backward recomputes the probabilities chunk by chunk. Formulas (z = x / T, p = softmax(z)):

    lse        = m + log(sum_i exp(z_i - m)),          m = max_i z_i
    logp_y     = (z_y - m) - log(s)         (not z_y - lse: m + log s loses log s ~ 1e-7)
    H          = log(s) - t / s,      e_i = exp(z_i - m), s = sum_i e_i, t = sum_i e_i (z_i - m)
    dlogp_y/dz_i = [i == y] - p_i
    dH/dz_i      = -p_i (log p_i + H)
    dL/dx_i      = (1/T) (g_logp ([i == y] - p_i) - g_H p_i (log p_i + H))

H is taken relative to m, like the Triton kernel: log s >= 0 and -t / s = E_p[m - z] >= 0, so H is a sum of two
non-negative terms and nothing cancels. s and t are reduced with torch.sum, whose pairwise accumulation keeps them
to ~1e-7 relative over 152k columns (a BLAS dot product for t did not: 2e-4 nats at V = 152k, T = 1.7).

The target column is computed separately as g_logp * (-expm1(logp_y)) - g_H p_y (logp_y + H) so
that 1 - p_y keeps its precision when p_y is close to 1.
"""

from dataclasses import dataclass

import torch

from ._common import prepare_tokens_mask, rows_view, run_backward, save_and_return

# Budget for the two fp32 scratch buffers of one chunk (so peak extra memory is ~CHUNK_BYTES beyond the
# outputs and, in the backward, the gradient). On a 2-core CPU, 32-128 MB ran as fast as or faster than the
# unchunked naive version, while 2-8 MB chunks were 3-4x slower (per-op overhead); see bench/logprobs.md.
CHUNK_BYTES = 128 * 2**20
_LOGP_CLAMP = -1.0e4  # log p below this has p == 0 in fp32; clamping avoids 0 * -inf = nan


def _chunk_rows(V: int, chunk_rows=None) -> int:
    if chunk_rows is not None:
        return max(1, int(chunk_rows))
    return max(1, CHUNK_BYTES // (2 * 4 * V))


def _load_z(xc, scale, inv_t, A):
    """z = x / T in fp32. Returns ``xc`` itself (read-only!) when no conversion is needed."""
    if xc.dtype == torch.float32 and inv_t == 1.0:
        return xc
    # ``scale`` is a 1-element fp32 tensor (not 0-d), so type promotion computes in fp32 even for bf16 x.
    torch.mul(xc, scale, out=A)
    return A


def _row_chunks(B, S, rows):
    for b in range(B):
        for s0 in range(0, S, rows):
            yield b, s0, min(S, s0 + rows)


def _forward_chunk(xc, yc, scale, inv_t, want_entropy, A, B_):
    z = _load_z(xc, scale, inv_t, A)
    z_y = z.gather(1, yc[:, None]).squeeze(1)
    m = z.amax(dim=1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf row: keep arithmetic nan-free
    torch.sub(z, m[:, None], out=A)  # A = z - m (in place when z is A)
    if want_entropy:
        torch.exp(A, out=B_)
        s = B_.sum(dim=1)
        # t = sum_i e_i (z_i - m) as a product and torch.sum (pairwise / cascaded accumulation), not a bmm: a BLAS
        # dot product accumulates 150k terms sequentially in fp32 (1e-5..1e-4 relative, i.e. 2e-4 nats of H at
        # V = 152k, T = 1.7). The clamp is exact: e_i is already 0 below -104, and it turns z_i = -inf into a
        # finite value so those terms give 0 * -1e4 = 0 instead of 0 * -inf = nan (nan logits stay nan).
        A.clamp_(min=_LOGP_CLAMP).mul_(B_)
        t = A.sum(dim=1)
        log_s = s.log()
        ent = log_s - t / s
    else:
        log_s = A.exp_().sum(dim=1).log()
        ent = None
    # (z_y - m) - log s, not z_y - lse: lse = m + log s would round log s away when p_y -> 1
    return (z_y - m) - log_s, m + log_s, ent


@dataclass
class RowStats:
    """What the backward reads per row: the target ids, the forward's lse, entropy (None without it) and log-prob, and
    the upstream gradients g_lp and g_h (None: the entropy did not reach the loss), both already times 1/T.
    ``stats[index]`` holds the same for some rows: ``stats[b, s0:s1]`` of (B, S) tensors, ``stats[s0:s1]`` of (N,)."""

    tokens: torch.Tensor
    lse: torch.Tensor
    ent: torch.Tensor | None
    logp: torch.Tensor
    g_lp: torch.Tensor
    g_h: torch.Tensor | None

    def __getitem__(self, index):
        return RowStats(
            self.tokens[index],
            self.lse[index],
            None if self.ent is None else self.ent[index],
            self.logp[index],
            self.g_lp[index],
            None if self.g_h is None else self.g_h[index],
        )


def _backward_chunk(xc, rows, scale, inv_t, A, B_, out):
    """Write dL/dx for one chunk of logits ``xc`` into ``out`` (any float dtype, rows may be strided); ``rows`` is the
    chunk's RowStats."""
    z = _load_z(xc, scale, inv_t, A)
    torch.sub(z, rows.lse[:, None], out=A)  # A = log p
    torch.exp(A, out=B_)  # B = p
    # target column in fp32, before any cast
    p_y = rows.logp.exp()
    c_y = rows.g_lp * (-torch.expm1(rows.logp))
    if rows.g_h is not None:
        c_y = c_y - rows.g_h * p_y * (rows.logp + rows.ent)
        A.add_(rows.ent[:, None]).clamp_(min=_LOGP_CLAMP)  # A = log p + H (finite)
        # A = -(g_lp + g_h (log p + H))
        torch.addcmul(-rows.g_lp[:, None], A, -rows.g_h[:, None], out=A)
        torch.mul(A, B_, out=out)
    else:
        torch.mul(B_, -rows.g_lp[:, None], out=out)
    out.scatter_(1, rows.tokens[:, None], c_y[:, None].to(out.dtype))


def _fill_grad(x3, grad3, saved, cfg, g_lp, g_h):
    """Write dL/dlogits into ``grad3`` chunk by chunk (the torch part of ``run_backward``); masked rows get 0."""
    _, tok, msk, lse, ent, logp = saved
    inv_t, _, _, chunk_rows = cfg
    Bn, Sn, V = x3.shape
    f32 = dict(dtype=torch.float32, device=x3.device)

    def prep(g):
        g = g.reshape(Bn, Sn).to(torch.float32) * inv_t
        if msk is not None:
            g = torch.where(msk, g, torch.zeros((), **f32))
        return g.contiguous()

    g_lp = prep(g_lp) if g_lp is not None else torch.zeros(Bn, Sn, **f32)
    g_h = prep(g_h) if g_h is not None else None
    stats = RowStats(tok, lse, ent, logp, g_lp, g_h)
    rows = min(_chunk_rows(V, chunk_rows), max(Sn, 1))
    A = torch.empty(rows, V, **f32)
    B_ = torch.empty(rows, V, **f32)
    scale = torch.full((1,), inv_t, **f32)
    for b, s0, s1 in _row_chunks(Bn, Sn, rows):
        n = s1 - s0
        out = grad3[b, s0:s1]
        _backward_chunk(x3[b, s0:s1], stats[b, s0:s1], scale, inv_t, A[:n], B_[:n], out)
        if msk is not None:
            mc = msk[b, s0:s1]
            if not bool(mc.all()):
                out.masked_fill_(~mc[:, None], 0)


class TorchTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, mask, temperature, want_entropy, inplace_backward, chunk_rows):
        x3, copied = rows_view(logits)
        Bn, Sn, V = x3.shape
        tok, msk = prepare_tokens_mask(tokens, mask, Bn, Sn)
        inv_t = 1.0 / float(temperature)
        dev = logits.device
        f32 = dict(dtype=torch.float32, device=dev)
        logp = torch.empty(Bn, Sn, **f32)
        lse = torch.empty(Bn, Sn, **f32)
        ent = torch.empty(Bn, Sn, **f32) if want_entropy else None
        rows = min(_chunk_rows(V, chunk_rows), max(Sn, 1))
        A = torch.empty(rows, V, **f32)
        B_ = torch.empty(rows, V, **f32) if want_entropy else None
        scale = torch.full((1,), inv_t, **f32)
        with torch.no_grad():
            for b, s0, s1 in _row_chunks(Bn, Sn, rows):
                n = s1 - s0
                lp, ls, en = _forward_chunk(
                    x3[b, s0:s1], tok[b, s0:s1], scale, inv_t, want_entropy, A[:n], None if B_ is None else B_[:n]
                )
                logp[b, s0:s1] = lp
                lse[b, s0:s1] = ls
                if want_entropy:
                    ent[b, s0:s1] = en
            if msk is not None:
                zero = torch.zeros((), **f32)
                logp = torch.where(msk, logp, zero)
                if want_entropy:
                    ent = torch.where(msk, ent, zero)
        del A, B_
        saved = (logits, tok, msk, lse, ent, logp)
        return save_and_return(ctx, saved, (inv_t, want_entropy, inplace_backward, chunk_rows))

    @staticmethod
    def backward(ctx, *grads):
        return run_backward(ctx, grads, _fill_grad)
