"""Shape helpers shared by the torch and Triton paths (no Triton import here)."""

import torch


def rows_view(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """View ``x`` of shape ``(..., V)`` as ``(B, S, V)`` with a unit last stride.

    Views such as ``logits[:, :-1]`` or a transposed ``(L, B, V) -> (B, L, V)`` layout cannot be
    flattened to 2-D without a copy, but they are still 3-D strided views, so both paths take a
    batch stride and a row stride instead of flattening. Returns ``(view, copied)``: ``copied`` is
    True only when a copy could not be avoided (last dim not contiguous, or a >3-D layout whose
    leading dims do not collapse).
    """
    copied = False
    if x.stride(-1) != 1:
        x = x.contiguous()
        copied = True
    V = x.shape[-1]
    if x.dim() == 1:
        return x.view(1, 1, V), copied
    try:
        return x.view(1, -1, V), copied  # leading dims collapse: one long run of rows
    except RuntimeError:
        pass
    if x.dim() == 3:
        return x, copied
    try:
        return x.view(-1, x.shape[-2], V), copied
    except RuntimeError:
        return x.reshape(-1, x.shape[-2], V), True


def check_token_range(tokens: torch.Tensor, mask, V: int) -> None:
    """Raise ValueError if an unmasked token id lies outside ``[0, V)``.

    Neither path bounds-checks the gather of the target logit (the Triton kernel would read another row, or
    outside the buffer), so the ids are checked here, before either runs: one min/max reduction over the
    unmasked ids, then one host read of the two results. On CUDA that read (``.tolist()``, like ``.item()``)
    synchronises with the stream once per call: the host waits for the queued work (e.g. the lm_head matmul)
    before launching the kernel, and the call cannot be captured in a CUDA graph. The slower search for the
    offending position runs only when raising.
    """
    if tokens.numel() == 0:
        return
    if mask is None:
        ids = tokens
    else:
        ids = torch.where(mask != 0, tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device))
    lo, hi = torch.aminmax(ids)
    lo, hi = torch.stack([lo, hi]).tolist()  # one device -> host sync on CUDA (see above)
    if 0 <= lo and hi < V:
        return
    bad = lo if lo < 0 else hi
    pos = tuple((ids == bad).nonzero()[0].tolist())
    raise ValueError(
        f"tokens hold id {bad} at unmasked position {pos}, outside the vocabulary [0, {V}) of the logits' last dim: "
        f"fix the ids, or pass mask with 0 at positions that hold padding or ignore ids such as -100 "
        f"(masked positions may hold any id)."
    )


def prepare_tokens_mask(tokens: torch.Tensor, mask, B: int, S: int):
    """Tokens as int64 ``(B, S)`` with masked positions set to 0 (so any id, e.g. -100, is safe to gather);
    mask as bool ``(B, S)`` or None."""
    tokens = tokens.to(torch.long).reshape(B, S)
    if mask is not None:
        mask = mask.to(device=tokens.device).reshape(B, S) != 0
        tokens = torch.where(mask, tokens, torch.zeros((), dtype=torch.long, device=tokens.device))
    return tokens, mask


def save_and_return(ctx, saved, cfg):
    """The end of both forwards: keep what the backward reads, ``saved`` = (logits, tokens, mask, lse, entropy, logp),
    and return logp (and entropy) shaped like the tokens. ``cfg`` is (1/T, want_entropy, inplace_backward, tuning
    knob)."""
    logits, _, _, _, ent, logp = saved
    ctx.save_for_backward(*saved)
    ctx.cfg = cfg
    ctx.set_materialize_grads(False)
    shape = logits.shape[:-1]
    if cfg[1]:
        return logp.view(shape), ent.view(shape)
    return logp.view(shape)


def run_backward(ctx, grads, fill):
    """The frame of both backwards: ``fill(x3, grad3, saved, cfg, g_lp, g_h)`` writes dL/dlogits into grad3 (the
    logits' own buffer when inplace), returned shaped like the logits. None: that output did not reach the loss."""
    saved = ctx.saved_tensors  # read first: it raises if the saved logits were modified in place
    cfg = ctx.cfg
    g_lp = grads[0]
    g_h = grads[1] if cfg[1] else None
    if g_lp is None and g_h is None:
        return (None,) * 7
    logits = saved[0]
    inplace = cfg[2]
    x3, copied = rows_view(logits)
    Bn, Sn, V = x3.shape
    if inplace:
        grad3 = x3  # overwrite the logits (or the private copy rows_view had to make)
    else:
        grad3 = torch.empty(Bn, Sn, V, dtype=logits.dtype, device=logits.device)
    fill(x3, grad3, saved, cfg, g_lp, g_h)
    if inplace and not copied:
        grad = logits
    else:
        grad = grad3.view(logits.shape) if grad3.is_contiguous() else grad3.reshape(logits.shape)
    return grad, None, None, None, None, None, None
