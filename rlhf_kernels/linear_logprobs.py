"""Fused lm_head + per-token log-probs (torch path): the (N, V) logits never exist.

Rows of ``hidden`` are processed in chunks: logits_chunk = hidden_chunk @ weight.T (in the hidden
dtype, as the unfused lm_head would), then the same per-chunk forward / backward as
``rlhf_kernels._torch_logprobs``. The backward recomputes each logits chunk, turns it into dL/dlogits
(in the logits dtype) and accumulates dL/dhidden = g @ W and dL/dW += g.T @ h (fp32 accumulator).
"""

import torch

from . import _torch_logprobs as _tl
from ._common import check_token_range, prepare_tokens_mask


def _rows(V, chunk_rows):
    if chunk_rows is not None:
        return max(1, int(chunk_rows))
    return max(1, _tl.CHUNK_BYTES // (3 * 4 * V))


class LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, mask, temperature, want_entropy, chunk_rows):
        H = hidden.shape[-1]
        V = weight.shape[0]
        h2 = hidden.reshape(-1, H)
        N = h2.shape[0]
        tok, msk = prepare_tokens_mask(tokens, mask, 1, N)
        tok = tok[0]
        if msk is not None:
            msk = msk[0]
        inv_t = 1.0 / float(temperature)
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp = torch.empty(N, **f32)
        lse = torch.empty(N, **f32)
        ent = torch.empty(N, **f32) if want_entropy else None
        rows = min(_rows(V, chunk_rows), max(N, 1))
        A = torch.empty(rows, V, **f32)
        B_ = torch.empty(rows, V, **f32) if want_entropy else None
        scale = torch.full((1,), inv_t, **f32)
        with torch.no_grad():
            for s0 in range(0, N, rows):
                s1 = min(N, s0 + rows)
                n = s1 - s0
                xc = h2[s0:s1] @ weight.t()
                lp, ls, en = _tl._forward_chunk(
                    xc, tok[s0:s1], scale, inv_t, want_entropy, A[:n], None if B_ is None else B_[:n]
                )
                logp[s0:s1] = lp
                lse[s0:s1] = ls
                if want_entropy:
                    ent[s0:s1] = en
            if msk is not None:
                zero = torch.zeros((), **f32)
                logp = torch.where(msk, logp, zero)
                if want_entropy:
                    ent = torch.where(msk, ent, zero)
        ctx.save_for_backward(hidden, weight, tok, msk, lse, ent, logp)
        ctx.cfg = (inv_t, want_entropy, chunk_rows)
        ctx.set_materialize_grads(False)
        shape = hidden.shape[:-1]
        if want_entropy:
            return logp.view(shape), ent.view(shape)
        return logp.view(shape)

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, tok, msk, lse, ent, logp = ctx.saved_tensors
        inv_t, want_entropy, chunk_rows = ctx.cfg
        g_lp = grads[0]
        g_h = grads[1] if want_entropy else None
        if g_lp is None and g_h is None:
            return (None,) * 7
        H = hidden.shape[-1]
        V = weight.shape[0]
        h2 = hidden.reshape(-1, H)
        N = h2.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)

        def prep(g):
            g = g.reshape(N).to(torch.float32) * inv_t
            if msk is not None:
                g = torch.where(msk, g, torch.zeros((), **f32))
            return g

        g_lp = prep(g_lp) if g_lp is not None else torch.zeros(N, **f32)
        g_h = prep(g_h) if g_h is not None else None
        stats = _tl.RowStats(tok, lse, ent, logp, g_lp, g_h)
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h2) if need_h else None
        grad_w = torch.zeros(weight.shape, **f32) if need_w else None
        rows = min(_rows(V, chunk_rows), max(N, 1))
        A = torch.empty(rows, V, **f32)
        B_ = torch.empty(rows, V, **f32)
        scale = torch.full((1,), inv_t, **f32)
        for s0 in range(0, N, rows):
            s1 = min(N, s0 + rows)
            n = s1 - s0
            hc = h2[s0:s1]
            xc = hc @ weight.t()
            _tl._backward_chunk(xc, stats[s0:s1], scale, inv_t, A[:n], B_[:n], xc)  # xc now holds dL/dlogits
            if msk is not None:
                xc.masked_fill_(~msk[s0:s1, None], 0)
            if need_h:
                if grad_h.dtype == xc.dtype:
                    torch.mm(xc, weight, out=grad_h[s0:s1])
                else:
                    grad_h[s0:s1].copy_(xc @ weight)
            if need_w:
                grad_w.add_((xc.t() @ hc).float())
        gh = grad_h.view(hidden.shape) if need_h else None
        gw = grad_w.to(weight.dtype) if need_w else None
        return gh, gw, None, None, None, None, None


def linear_token_logprobs(hidden, weight, tokens, temperature=1.0, return_entropy=False, mask=None):
    """``token_logprobs(hidden @ weight.T, tokens, ...)`` without materialising the logits (torch path).

    hidden ``(..., H)``, weight ``(V, H)`` (the lm_head weight, no bias), tokens ``(...)``. Returns fp32 log-probs
    (and entropy when ``return_entropy``); differentiable w.r.t. hidden and weight. Masked positions give 0 and
    contribute no gradient.
    """
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError("weight must be (V, H) with H == hidden.shape[-1]")
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]):
        raise ValueError("tokens must have shape hidden.shape[:-1]")
    if not float(temperature) > 0:
        raise ValueError("temperature must be > 0")
    tokens = tokens.to(hidden.device)
    check_token_range(tokens, None if mask is None else mask.to(hidden.device), weight.shape[0])
    return LinearTokenLogprobs.apply(hidden, weight, tokens, mask, float(temperature), bool(return_entropy), None)
