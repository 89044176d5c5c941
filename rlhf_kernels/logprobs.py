"""Dispatcher for :func:`token_logprobs` (torch path everywhere, Triton path on CUDA)."""

import os

import torch

from ._common import check_token_range

_TRITON_OK = None


def _triton_available() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_OK = True
        except Exception:  # ImportError, or a broken install on an unsupported platform
            _TRITON_OK = False
    return _TRITON_OK


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    mask=None,
    backend: str = "auto",
    inplace_backward: bool = False,
    check_range: bool = True,
):
    """Log-probability of ``tokens`` under ``softmax(logits / temperature)``, without an fp32 (N, V) copy.

    Args:
        logits: ``(..., V)`` bf16 / fp16 / fp32; only the last dim needs to be contiguous
            (``logits[:, :-1]`` is used as is).
        tokens: ``(...)`` integer token ids in ``[0, V)`` at unmasked positions (else ValueError; checked with
            one reduction, which on CUDA synchronises once per call).
        temperature: positive float; the logits are divided by it before the softmax.
        return_entropy: also return the entropy of ``softmax(logits / temperature)`` per position.
        mask: optional ``(...)`` bool / 0-1; masked-out positions give logp 0, entropy 0 and zero
            gradient (their token ids are never read, so e.g. -100 is fine there).
        backend: ``"auto"`` (Triton for CUDA tensors when triton imports, else torch), ``"triton"``
            or ``"torch"``.
        inplace_backward: let the backward write the gradient into the logits' buffer (saves one
            logits-sized allocation). Unsafe if anything else still needs those logits after the
            backward (the torch path and the version counter will usually make autograd raise).
        check_range: check the token ids (the ValueError above). False skips the check, and with it the host
            synchronisation, so that the call can be captured in a CUDA graph: only for ids known to lie in
            range, such as tokens sampled from these very logits (an id outside reads another row, or memory
            outside the buffer, on the Triton path).

    Returns:
        fp32 ``(...)`` log-probs, or ``(logp, entropy)`` when ``return_entropy``. Differentiable
        w.r.t. ``logits``; the gradient has the logits' dtype.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have shape (..., V)")
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != logits.shape[:-1] {tuple(logits.shape[:-1])}")
    if mask is not None and tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} != tokens shape {tuple(tokens.shape)}")
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError("temperature must be > 0")
    if not logits.is_floating_point():
        raise TypeError("logits must be a floating-point tensor")
    tokens = tokens.to(device=logits.device)
    if mask is not None:
        mask = mask.to(device=logits.device)
    # both backends gather the target logit unchecked: refuse ids outside [0, V) here (syncs once on CUDA)
    if check_range:
        check_token_range(tokens, mask, logits.shape[-1])

    if backend == "auto":
        backend = "triton" if (logits.is_cuda and _triton_available()) else "torch"
    if backend == "triton":
        if not _triton_available():
            raise ImportError("backend='triton' requested but triton is not importable")
        if not logits.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "backend='triton' on non-CUDA tensors needs TRITON_INTERPRET=1 set before importing triton"
            )
        from ._triton_logprobs import TritonTokenLogprobs

        return TritonTokenLogprobs.apply(
            logits, tokens, mask, temperature, bool(return_entropy), bool(inplace_backward), None
        )
    if backend == "torch":
        from ._torch_logprobs import TorchTokenLogprobs

        return TorchTokenLogprobs.apply(
            logits, tokens, mask, temperature, bool(return_entropy), bool(inplace_backward), None
        )
    raise ValueError(f"unknown backend {backend!r} (expected 'auto', 'triton' or 'torch')")
