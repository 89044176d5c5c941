"""The scripts' fast paths, each with a plain equivalent in the scripts: memory-lean per-token log-probabilities (and
entropy) for RLHF policy losses, and generate's decode loop captured as CUDA graphs.

Public surface::

    from rlhf_kernels import token_logprobs
    logp = token_logprobs(logits, tokens)                                    # (...,) fp32
    logp, ent = token_logprobs(logits, tokens, temperature=0.7, return_entropy=True, mask=mask)

``linear_token_logprobs(hidden, weight, tokens, ...)`` fuses the lm_head matmul (torch path only).
``static_decode(policy, cache, logits, prompt_mask, next_position, uniforms, sampling, sample_token)`` runs the
scripts' decode steps on a StaticCache, each step a CUDA graph on CUDA (op by op elsewhere).

Only torch is required (and transformers, for static_decode); Triton is imported lazily and only used for CUDA tensors
(or when ``backend="triton"`` is forced, e.g. under ``TRITON_INTERPRET=1`` on CPU).
"""

from .decode import static_decode
from .linear_logprobs import linear_token_logprobs
from .logprobs import token_logprobs

__all__ = ["token_logprobs", "linear_token_logprobs", "static_decode"]
