"""Memory-lean per-token log-probabilities (and entropy) for RLHF policy losses.

Public surface::

    from rlhf_kernels import token_logprobs
    logp = token_logprobs(logits, tokens)                                    # (...,) fp32
    logp, ent = token_logprobs(logits, tokens, temperature=0.7, return_entropy=True, mask=mask)

``linear_token_logprobs(hidden, weight, tokens, ...)`` fuses the lm_head matmul (torch path only).

Only torch is required; Triton is imported lazily and only used for CUDA tensors
(or when ``backend="triton"`` is forced, e.g. under ``TRITON_INTERPRET=1`` on CPU).
"""

from .linear_logprobs import linear_token_logprobs
from .logprobs import token_logprobs

__all__ = ["token_logprobs", "linear_token_logprobs"]
