"""GPU paths against the CPU path (skipped without CUDA; CI has none, the device machine does).

Every registered mechanism runs on CUDA and must match its own CPU result:
* fp32 forward and gradients of q, k, v: atol = rtol = 1e-4 (TF32 off; GPU kernels sum in
  another order than CPU ones, so bit equality is not expected);
* bf16 on CUDA against fp32 on CPU: atol = rtol = 5e-2 on the output (bf16 keeps 8
  mantissa bits, eps 7.8e-3; an attention output is a convex mix of values ~ N(0, 1)).
  Mechanisms that make hard decisions on scores (JAT's thresholded jump links, LSH's
  argmax buckets, SAC's top-k edges) may flip one in bf16 and move that row by O(1), so
  for them the check is that the result is finite and close on average (mean |diff| < 5e-2).
* The CPU and CUDA runs use separate copies of the module: ``Module.cuda()`` moves
  parameters in place, which would put the CPU graph's saved parameters on the GPU.
* The same fp32 check at n = 300 (``test_cuda_fp32_matches_cpu_at_length``), past the
  lengths where the length-dependent paths take over: the blocked sparse engine (head dim 8
  is below FlexAttention's 16, so CUDA runs the same engine as the CPU), the Gaussian
  prior's convolution, adaptive span's chunked band, SAC's chunked edge scoring, the
  gathered and top-key engines; hard-decision mechanisms (THRESHOLDED and CHOOSING) are
  checked on the mean difference, as in bf16.
* A tiny BERT with the BERT-JAT plan: logits and all parameter gradients, CUDA vs CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_contract import NAMES, build, ctx, qkv, spec  # tests/mechanisms is on sys.path

import attnlab

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# hard decisions on scores (thresholds, argmax buckets, top-k): bf16 may flip individual ones
THRESHOLDED = {"jat", "lsh", "sac"}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _run(mech, q, k, v, key_mask):
    res = mech(q, k, v, ctx(key_mask=key_mask))
    return res.out


@pytest.mark.parametrize("name", NAMES)
def test_cuda_fp32_matches_cpu(name):
    mech = build(name)
    q, k, v = (t.requires_grad_() for t in qkv(29))
    key_mask = torch.arange(29)[None, :] < torch.tensor([29, 17, 5])[:, None]
    out = _run(mech, q, k, v, key_mask)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out_c = _run(copy.deepcopy(mech).cuda(), qc, kc, vc, key_mask.cuda())
    torch.testing.assert_close(out_c.cpu(), out, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
    grads_c = torch.autograd.grad(out_c, (qc, kc, vc), g.cuda(), allow_unused=True)
    for a, r in zip(grads_c, grads, strict=True):
        assert (a is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(a.cpu(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_cuda_bf16_close_to_fp32(name):
    mech = build(name)
    q, k, v = qkv(29)
    key_mask = torch.arange(29)[None, :] < torch.tensor([29, 17, 5])[:, None]
    ref = _run(mech, q, k, v, key_mask)
    mech_b = copy.deepcopy(mech).cuda().to(torch.bfloat16)
    qb, kb, vb = (t.cuda().to(torch.bfloat16) for t in (q, k, v))
    out = _run(mech_b, qb, kb, vb, key_mask.cuda()).float().cpu()
    assert torch.isfinite(out).all()
    if name in THRESHOLDED:
        assert (out - ref).abs().mean() < 5e-2
    else:
        torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


# k-means assignments (argmax over centroids) and ProbSparse's top-u queries may flip on a
# near-tie at this length, as THRESHOLDED's decisions may
CHOOSING = {"clustered", "improved_clustered", "routing", "probsparse"}


@pytest.mark.parametrize("name", NAMES)
def test_cuda_fp32_matches_cpu_at_length(name):
    n = 300
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(spec(name), attnlab.HeadDims(4, 8, 512)).eval()
    q, k, v = (t.requires_grad_() for t in qkv(n, seed=3))
    key_mask = torch.arange(n)[None, :] < torch.tensor([n, 211, 40])[:, None]
    out = _run(mech, q, k, v, key_mask)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out_c = _run(copy.deepcopy(mech).cuda(), qc, kc, vc, key_mask.cuda())
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
    grads_c = torch.autograd.grad(out_c, (qc, kc, vc), g.cuda(), allow_unused=True)
    hard = name in THRESHOLDED | CHOOSING
    for a, r in zip((out_c, *grads_c), (out, *grads), strict=True):
        assert (a is None) == (r is None)
        if r is None:
            continue
        a = a.detach().cpu()
        assert torch.isfinite(a).all()
        if hard:
            assert (a - r).abs().mean() < 5e-2 * r.abs().mean().clamp_min(1e-3)
        else:
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


def test_bert_jat_plan_cuda_matches_cpu():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).eval()
    plan = [{"layers": [0, 1, 3], "heads": [0, 2], "mechanism": "jat(rho=0.05, coef=0.5)"}]
    attnlab.apply_plan(model, plan)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 23), generator=g)
    mask = (torch.arange(23)[None, :] < torch.tensor([23, 15, 7])[:, None]).long()

    def step(m, device):
        m.zero_grad()
        out = m(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        out.square().sum().backward()
        return out.detach().cpu(), {n: p.grad.detach().cpu() for n, p in m.named_parameters()
                                    if p.grad is not None}

    logits, grads = step(model, "cpu")
    logits_c, grads_c = step(model.cuda(), "cuda")
    torch.testing.assert_close(logits_c, logits, atol=1e-4, rtol=1e-4)
    assert grads_c.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(grads_c[n], grads[n], atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.parametrize("n", [40, 300])
@pytest.mark.parametrize("method", ["auto", "direct", "pairs", "compare", "enumerate"])
def test_jump_counts_on_cuda_equal_naive_exactly(n, method):
    """Integer link counts on the GPU (auto = direct for short inputs, candidate pairs or
    the sorted ranges beyond _DIRECT_MAX_N) equal the naive n^3 form on the same GPU."""
    from attnlab.mechanisms._jat_adjacency import jump_counts, key_length, naive_jump_counts

    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, 3, n, 8, generator=g) * 1.5
    k = torch.randn(2, 3, n, 8, generator=g) * 1.5
    s, lk = (q @ k.transpose(-1, -2)).cuda(), key_length(k).cuda()
    valid = (torch.arange(n)[None, :] < torch.tensor([n, n // 2])[:, None])[:, None, :].cuda()
    for rho, sign, vm in [(0.5, False, None), (0.3, True, valid)]:
        ref = naive_jump_counts(s, lk, 8, rho, sign, vm)
        got = jump_counts(s, lk, 8, rho, sign, vm, method)
        assert torch.equal(got.long(), ref), (n, method, rho, sign)
