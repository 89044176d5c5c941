"""rlhf_kernels.token_logprobs against an fp64 torch reference, on the torch path and on the Triton path
(under TRITON_INTERPRET=1 on CPU, set by conftest.py). Shapes are kept small: the interpreter is slow."""

import importlib.util
import os

import pytest
import torch

from rlhf_kernels import token_logprobs

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")),
]
# numpy warns about the 0 * -inf / log(0) lanes the kernels discard with tl.where
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# (logp/entropy atol, grad tolerance relative to the largest |grad|) per input dtype. Outputs are fp32
# in every case; the bf16/fp16 error comes from rounding the inputs (compared exactly in fp64) and the
# gradient store.
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-5, 2e-3), torch.bfloat16: (2e-5, 1e-2)}


def reference(logits, tokens, temperature=1.0, mask=None):
    """fp64 log_softmax + gather, entropy from fp64 probabilities (p log p := 0 where p == 0)."""
    z = logits.double() / temperature
    if mask is not None:  # masked rows may hold garbage (nan); keep it out of the reference's graph
        z = torch.where(mask.bool()[..., None], z, torch.zeros_like(z))
    lp = torch.log_softmax(z, dim=-1)
    p = lp.exp()
    logp = lp.gather(-1, tokens.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)  # masked ids may be anything
    ent = -(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)
    if mask is not None:
        logp = torch.where(mask.bool(), logp, torch.zeros_like(logp))
        ent = torch.where(mask.bool(), ent, torch.zeros_like(ent))
    return logp, ent


def check(logits, tokens, backend, temperature=1.0, mask=None, fn=None, inplace=False):
    """Forward and backward of w1 . logp + w2 . H versus the fp64 reference; returns (logp, ent, grad)."""
    dtype = logits.dtype
    atol, gtol = TOL[dtype]
    x = logits.detach().clone().requires_grad_(True)
    xr = logits.detach().double().requires_grad_(True)
    if fn is None:
        lp, ent = token_logprobs(x, tokens, temperature, True, mask=mask, backend=backend, inplace_backward=inplace)
    else:
        lp, ent = fn(x, tokens, temperature, True, mask)
    rlp, rent = reference(xr, tokens, temperature, mask)
    assert lp.dtype == torch.float32
    assert ent.dtype == torch.float32
    assert lp.shape == tokens.shape
    assert ent.shape == tokens.shape
    torch.testing.assert_close(lp.double(), rlp.detach(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent.detach(), atol=atol, rtol=1e-5)
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(tokens.shape, generator=g).to(tokens.device)
    w2 = torch.randn(tokens.shape, generator=g).to(tokens.device)
    (lp * w1 + ent * w2).sum().backward()
    (rlp * w1.double() + rent * w2.double()).sum().backward()
    assert x.grad.dtype == dtype
    assert x.grad.shape == x.shape
    scale = xr.grad.abs().max().item()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=gtol * scale + 3e-7, rtol=0)
    return lp, ent, x.grad


def rand_logits(shape, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def rand_tokens(shape, V, seed=0):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed + 100))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,temperature", [(1000, 1.0), (1000, 0.7), (100, 0.7)])
def test_matches_reference(backend, dtype, V, temperature):
    # V=1000: not a multiple of the (1024) block; V=100: smaller than the block
    x = rand_logits((24, V), dtype)
    check(x, rand_tokens((24,), V), backend, temperature)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("block", [256, None])
def test_triton_multiple_blocks(block):
    from rlhf_kernels._triton_logprobs import TritonTokenLogprobs

    # block=256: V=1000 spans 4 blocks, the last one partial; default block (4096) with V just above it
    if block:
        V = 1000
        N = 16
    else:
        V = 4100
        N = 3
    x = rand_logits((N, V), torch.float32, seed=3)
    x[0, 40:900] = float("-inf")  # a -inf run crossing block boundaries

    def fn(x, y, T, e, m):
        return TritonTokenLogprobs.apply(x, y, m, T, e, False, block)

    lp, _, _ = check(x, rand_tokens((N,), 40, seed=3), "triton", 0.7, fn=fn)
    assert (lp <= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_without_copy(backend):
    B = 3
    L = 9
    V = 300
    full = rand_logits((B, L, V), seed=5)
    view = full[:, :-1]  # (B, L-1, V): leading dims do not collapse
    tok = rand_tokens((B, L - 1), V)
    check(view, tok, backend, 0.7)
    seq_major = rand_logits((L, B, V), torch.bfloat16, seed=6).transpose(0, 1)  # (B, L, V), strides (V, B*V, 1)
    check(seq_major, rand_tokens((B, L), V), backend)
    # in-place backward on the view writes into the original buffer: proof that no copy was made
    x = full.clone().requires_grad_(True)
    y = x * 1.0
    v = y[:, :-1]
    lp = token_logprobs(v, tok, backend=backend, inplace_backward=True)
    grads = []
    v.register_hook(grads.append)
    lp.sum().backward()
    assert grads[0].data_ptr() == v.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_dims(backend):
    check(rand_logits((2, 3, 5, 200), seed=7), rand_tokens((2, 3, 5), 200), backend, 0.7)
    check(rand_logits((200,), seed=8), rand_tokens((), 200), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_rows(backend, dtype):
    V = 500
    N = 8
    x = rand_logits((N, V), seed=9, scale=1.0)
    tok = rand_tokens((N,), V)
    rows = torch.arange(N)
    # target logit such that p_y = 1 - 1e-6: z_y = log((1 - eps) / eps * sum_{i != y} exp(z_i))
    others = x.clone()
    others[rows, tok] = float("-inf")
    x[rows, tok] = (torch.logsumexp(others.double(), -1) + torch.log(torch.tensor((1 - 1e-6) / 1e-6))).float()
    x = x.to(dtype)
    lp, ent, grad = check(x, tok, backend)
    rlp = reference(x, tok)[0].float()
    # still ~1e-6 after rounding the inputs
    assert (rlp > -3e-6).all()
    assert (rlp < -1e-7).all()
    # fp32 floor: log(1 + 1e-6) carries ~6e-8 of rounding, so allow 3e-7 absolute on a value of 1e-6
    torch.testing.assert_close(lp, rlp, atol=3e-7, rtol=0)
    # d logp_y / d z_y = 1 - p_y ~ 1e-6 must survive the cast to the logits' dtype (no cancellation to 0)
    xa = x.clone().requires_grad_(True)
    xr = x.double().requires_grad_(True)
    token_logprobs(xa, tok, backend=backend).sum().backward()
    reference(xr, tok)[0].sum().backward()
    gy = xa.grad[rows, tok].double()
    ry = xr.grad[rows, tok]
    assert (gy > 0).all()
    torch.testing.assert_close(gy, ry, atol=3e-7, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rows(backend, dtype):
    B = 2
    L = 6
    V = 300
    x = rand_logits((B, L, V), dtype, seed=10)
    tok = rand_tokens((B, L), V)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :2] = False
    mask[1, 5] = False
    tok[~mask] = -100  # ignore-index style ids must never be read at masked positions
    x[1, 5] = float("nan")  # garbage in a masked row must not leak
    lp, ent, grad = check(x, tok, backend, 0.7, mask=mask.to(torch.int64))
    assert (lp[~mask] == 0).all()
    assert (ent[~mask] == 0).all()
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_entries(backend):
    V = 300
    x = rand_logits((6, V), seed=11)
    tok = rand_tokens((6,), 50)
    x[0, 100:] = float("-inf")
    x[1, ::2] = float("-inf")
    x[2, 60] = float("-inf")
    tok[1] = 1
    lp, ent, grad = check(x, tok, backend, 0.7)
    assert torch.isfinite(lp).all()
    assert torch.isfinite(ent).all()
    assert torch.isfinite(grad).all()
    assert (grad[0, 100:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_and_default_leaves_logits(backend, dtype):
    x0 = rand_logits((4, 5, 300), dtype, seed=12)
    tok = rand_tokens((4, 5), 300)
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) > 0.3

    def grad_of(inplace):
        leaf = x0.clone().requires_grad_(True)
        logits = leaf * 1  # a non-leaf, as the lm_head output would be
        lp, ent = token_logprobs(logits, tok, 0.7, True, mask=mask, backend=backend, inplace_backward=inplace)
        (lp.sum() + 0.3 * ent.sum()).backward()
        return leaf.grad, logits.detach()

    g_default, logits_after = grad_of(False)
    assert torch.equal(logits_after, x0)  # default backward leaves the logits untouched
    g_inplace, logits_after_inplace = grad_of(True)
    torch.testing.assert_close(g_inplace, g_default, atol=0, rtol=0)
    torch.testing.assert_close(logits_after_inplace, g_inplace, atol=0, rtol=0)  # ...and the buffer holds the grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_outputs(backend):
    """Only logp used (no entropy), and only entropy used (no logp grad)."""
    x = rand_logits((10, 250), seed=13)
    tok = rand_tokens((10,), 250)
    xa = x.clone().requires_grad_(True)
    lp = token_logprobs(xa, tok, 0.7, backend=backend)
    assert isinstance(lp, torch.Tensor)
    lp.sum().backward()
    xr = x.double().requires_grad_(True)
    reference(xr, tok, 0.7)[0].sum().backward()
    torch.testing.assert_close(xa.grad.double(), xr.grad, atol=1e-6, rtol=0)
    xb = x.clone().requires_grad_(True)
    _, ent = token_logprobs(xb, tok, 0.7, return_entropy=True, backend=backend)
    ent.sum().backward()
    xr.grad = None
    reference(xr, tok, 0.7)[1].sum().backward()
    torch.testing.assert_close(xb.grad.double(), xr.grad, atol=1e-6, rtol=0)


def test_torch_chunking_is_exact():
    from rlhf_kernels._torch_logprobs import TorchTokenLogprobs

    x0 = rand_logits((3, 7, 333), torch.bfloat16, seed=14)
    tok = rand_tokens((3, 7), 333)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) > 0.2
    outs = []
    for rows in (1, 3, None):
        x = x0.clone().requires_grad_(True)
        lp, ent = TorchTokenLogprobs.apply(x[:, :-1], tok[:, :-1], mask[:, :-1], 0.7, True, False, rows)
        (lp.sum() - 0.5 * ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), x.grad))
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            assert torch.equal(a, b)


def test_auto_picks_torch_on_cpu(monkeypatch):
    from rlhf_kernels import _torch_logprobs

    calls = []
    orig = _torch_logprobs.TorchTokenLogprobs.apply

    def counted(*a):
        calls.append(1)
        return orig(*a)

    monkeypatch.setattr(_torch_logprobs.TorchTokenLogprobs, "apply", counted)
    token_logprobs(rand_logits((2, 50)), rand_tokens((2,), 50))
    assert calls == [1]


def test_bad_arguments():
    x = rand_logits((2, 50))
    with pytest.raises(ValueError):
        token_logprobs(x, rand_tokens((3,), 50))
    with pytest.raises(ValueError):
        token_logprobs(x, rand_tokens((2,), 50), temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(x, rand_tokens((2,), 50), backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_linear_token_logprobs_matches_unfused(dtype, chunk_rows):
    from rlhf_kernels.linear_logprobs import LinearTokenLogprobs

    g = torch.Generator().manual_seed(20)
    B = 2
    L = 7
    Hd = 32
    V = 300
    h0 = torch.randn(B, L, Hd, generator=g).to(dtype)
    w0 = (torch.randn(V, Hd, generator=g) / Hd**0.5 * 3).to(dtype)
    tok = rand_tokens((B, L), V)
    mask = torch.rand(B, L, generator=g) > 0.3
    tok[~mask] = -100
    w1 = torch.randn(B, L, generator=g)
    w2 = torch.randn(B, L, generator=g)

    def run(fused):
        h = h0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        if fused:
            lp, ent = LinearTokenLogprobs.apply(h, w, tok, mask, 0.7, True, chunk_rows)
        else:
            lp, ent = token_logprobs(h @ w.t(), tok, 0.7, True, mask=mask, backend="torch")
        ((lp * w1).sum() + (ent * w2).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    fused = run(True)
    ref = run(False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(fused, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert (fused[0][~mask] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["V", -1])
def test_out_of_range_tokens(backend, bad):
    """Unmasked ids outside [0, V) raise one ValueError in the dispatcher (the same for both backends); the same ids
    at masked positions are never read and give 0."""
    V = 50
    bad = V if bad == "V" else bad
    x = rand_logits((2, 3, V), seed=15)
    tok = rand_tokens((2, 3), V)
    tok[1, 2] = bad
    with pytest.raises(ValueError) as err:
        token_logprobs(x, tok, 0.7, return_entropy=True, backend=backend)
    msg = str(err.value)
    assert f"id {bad} " in msg
    assert f"[0, {V})" in msg
    assert "(1, 2)" in msg
    assert "mask" in msg
    # the message does not depend on the backend, and a 0-1 mask with the bad id on an unmasked position still raises
    with pytest.raises(ValueError) as err_torch:
        token_logprobs(x, tok, 0.7, mask=torch.ones(2, 3, dtype=torch.int64), backend="torch")
    assert str(err_torch.value) == msg
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    lp, ent, grad = check(x, tok, backend, 0.7, mask=mask)
    assert lp[1, 2] == 0
    assert ent[1, 2] == 0
    assert (grad[1, 2] == 0).all()
    if backend == "torch":  # the fused lm_head path checks the same way
        from rlhf_kernels import linear_token_logprobs

        h = rand_logits((2, 3, 8), seed=17)
        w = rand_logits((V, 8), seed=18)
        with pytest.raises(ValueError) as err_linear:
            linear_token_logprobs(h, w, tok)
        assert str(err_linear.value) == msg
        assert linear_token_logprobs(h, w, tok, mask=mask)[1, 2] == 0


def test_check_range_false_skips_only_the_check(monkeypatch):
    """check_range=False (for tokens sampled from the logits, so that a CUDA graph can hold the call) gives what the
    checked call gives and never runs the check, the one host sync."""
    from rlhf_kernels import logprobs

    x = rand_logits((4, 50), seed=19)
    tok = rand_tokens((4,), 50)
    checked = token_logprobs(x, tok, 0.7)

    def refuse(*a):
        pytest.fail("the range was checked")

    monkeypatch.setattr(logprobs, "check_token_range", refuse)
    assert torch.equal(token_logprobs(x, tok, 0.7, check_range=False), checked)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_large_vocab_high_temperature(backend, dtype):
    """Qwen-size vocabulary at T = 1.7: H ~ 10 nats summed over 152k terms. A BLAS dot product for
    sum_i e_i (z_i - m) (sequential fp32 accumulation) put the torch path 2e-4 (fp32) / 1e-4 (bf16) nats off
    here; both paths must stay within 1e-5 of fp64."""
    V = 151_936
    T = 1.7
    n = 6 if backend == "torch" else 2  # the Triton interpreter is slow at this V
    x = rand_logits((n, V), dtype, seed=16, scale=4.0)
    tok = rand_tokens((n,), V, seed=16)
    lp, ent = token_logprobs(x, tok, T, return_entropy=True, backend=backend)
    rlp, rent = reference(x, tok, T)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=0)


COMPILED_CUDA = torch.cuda.is_available() and HAS_TRITON and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.skipif(
    not COMPILED_CUDA, reason="needs a GPU and compiled Triton: TRITON_INTERPRET=0 python -m pytest -k cuda"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,temperature", [(32768, 1.0), (151936, 0.7)])
def test_cuda_compiled_kernel_matches_fp64(dtype, V, temperature):
    """The compiled kernel on a GPU at real vocabulary sizes (Qwen2's 151,936 is not a power of two), with
    a mask, against the fp64 reference; CI has no GPU, so this runs only where one is."""
    logits = rand_logits((4, 256, V), dtype).cuda()
    tokens = rand_tokens((4, 256), V).cuda()
    mask = (torch.arange(256) < torch.tensor([[256], [200], [17], [1]])).cuda()
    check(logits, tokens, "triton", temperature, mask)
