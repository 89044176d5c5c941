"""The scripts' decode loop on buffers of fixed shape and a transformers StaticCache; on CUDA each step is captured
once as a CUDA graph and replayed (one launch a step instead of hundreds). The plain equivalent is the scripts'
`generate` loop over a DynamicCache: `static_decode` takes over from its prefill and gives what it gives."""

import warnings

import torch

DECODERS = {}  # (policy, batch size, sampling settings, sample_token) -> StaticDecoder, kept from call to call


def static_decode(policy, cache, logits, prompt_mask, next_position, uniforms, sampling, sample_token):
    """generate's decode steps from its prefill (cache, last logits (B, V), next positions (B, 1)), drawing with its
    sample_token; sampling as the scripts' Sampling. Returns generate's (tokens, logprobs, mask), each (B, T)."""
    B, P = prompt_mask.shape
    T = sampling.max_new_tokens
    key = (policy, B, T, sampling.pad_token_id, torch.as_tensor(sampling.stop_ids).numel(), sample_token)
    if key not in DECODERS or DECODERS[key].width < P + T:
        DECODERS.pop(key, None)  # the narrower one's memory goes before the wider one's comes
        width = -(-(P + T) // 64) * 64
        DECODERS[key] = StaticDecoder(policy, logits, width, sampling, sample_token, capture=logits.is_cuda)
    return DECODERS[key].run(policy, cache, logits, prompt_mask, next_position, uniforms, sampling.temperature)


class StaticDecoder:
    """generate's decode steps on buffers allocated once, counters on the device: with capture (on CUDA) a step is
    one CUDA graph."""

    def __init__(self, policy, logits, width, sampling, sample_token, capture):
        from transformers.cache_utils import StaticCache  # here: the log-prob kernels need torch alone

        B = logits.shape[0]
        device = logits.device
        max_new_tokens = sampling.max_new_tokens
        self.width = width
        self.cache = StaticCache(config=policy.config, max_cache_len=width)
        self.pad_token_id = sampling.pad_token_id
        self.sample_token = sample_token  # the script's: (logits (B, V), uniforms (B,) or None, T) -> token, log-prob
        self.capture = capture  # whether to capture each step as a CUDA graph
        self.graphs = {}  # (temperature, greedy) -> the captured step, or None where the capture failed
        self.logits = torch.zeros_like(logits)  # (B, V) the next token is drawn from
        self.stop_ids = torch.as_tensor(sampling.stop_ids, device=device).view(-1).clone()  # (S,), from one id too
        self.uniforms = torch.zeros(B, max_new_tokens, device=device)  # (B, T)
        long = dict(dtype=torch.long, device=device)
        self.attention_mask = torch.zeros(B, width, **long)  # (B, W) the columns in use
        self.position = torch.zeros(B, 1, **long)  # (B, 1) of the token fed next
        self.step = torch.zeros(1, **long)  # t, the token drawn next
        self.column = torch.zeros(1, **long)  # P + t, its column
        self.done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        self.tokens = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)  # (B, T)
        self.logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)  # (B, T)
        self.masks = torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device)  # (B, T)

    def run(self, policy, cache, logits, prompt_mask, next_position, uniforms, temperature):
        """The steps from generate's prefill on, for prompts (B, P); returns what generate returns."""
        P = prompt_mask.shape[1]
        self.cache.reset()  # in place: the captured steps read these very tensors
        for i, layer in enumerate(cache.layers):  # the prompt's keys and values fill the first P columns
            self.cache.update(layer.keys, layer.values, i)
        self.logits.copy_(logits)
        if uniforms is not None:
            self.uniforms.copy_(uniforms)
        self.attention_mask.zero_()[:, :P] = prompt_mask
        self.position.copy_(next_position)
        self.step.zero_()
        self.column.fill_(P)
        self.done.zero_()
        every = 8 if logits.is_cuda else 1  # the stop test is a host sync: on CUDA every 8 steps (pads fed meanwhile)
        for step in range(self.tokens.shape[1]):
            self.advance(policy, (temperature, uniforms is None))
            if (step + 1) % every == 0 and self.done.all():
                break
        T = int(self.masks[:, : step + 1].sum(1).max())  # the plain loop stops after the last live row's stop
        return self.tokens[:, :T].clone(), self.logprobs[:, :T].clone(), self.masks[:, :T].long()

    def advance(self, policy, mode):
        """One step of mode (temperature, greedy): replayed where it was captured, else run op by op (with capture,
        captured after its first run)."""
        if self.graphs.get(mode) is not None:
            self.graphs[mode].replay()
            return
        if not self.capture or mode in self.graphs:  # no capture here, or it failed
            self.step_once(policy, *mode)
            return
        # one step op by op on the capture's stream (Triton compiles, cuBLAS sets up), then the capture: it runs nothing
        self.graphs[mode] = None  # until the capture succeeds
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.step_once(policy, *mode)
        found = torch.cuda.current_stream()
        found.wait_stream(stream)
        try:
            with torch.cuda.graph(graph, stream=stream):
                self.step_once(policy, *mode)
            self.graphs[mode] = graph
        except RuntimeError as e:  # a layer that reads a value on the host (a routed MoE's expert list, say)
            warnings.warn(
                f"the decode step could not be captured as a CUDA graph ({str(e).splitlines()[0]}); it runs "
                "op by op, the same steps without the graph.",
                stacklevel=2,
            )
        finally:  # a failed capture leaves its stream the current one (torch.cuda.graph's exit stops at the error)
            torch.cuda.set_stream(found)

    def step_once(self, policy, temperature, greedy):
        """Draw every row's token t, record it, and feed it to the policy: the body of generate's loop."""
        uniforms = None if greedy else self.uniforms.index_select(1, self.step)[:, 0]  # (B,)
        token, logprob = self.sample_token(self.logits, uniforms, temperature)
        fed = torch.where(self.done, self.pad_token_id, token)  # (B,) pad tokens after a row's stop
        self.masks.index_copy_(1, self.step, ~self.done[:, None])
        self.tokens.index_copy_(1, self.step, fed[:, None])
        self.logprobs.index_copy_(1, self.step, torch.where(self.done, 0.0, logprob)[:, None])
        self.done |= (token[:, None] == self.stop_ids).any(-1)  # isin, without the sort a capture may not hold
        self.attention_mask.index_fill_(1, self.column, 1)
        out = policy(
            input_ids=fed[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.position,
            cache=self.cache,
            use_cache=True,
        )
        self.logits.copy_(out.logits[:, -1])
        for counter in (self.position, self.step, self.column):
            counter.add_(1)
