"""Random valid configs of every registered mechanism, for the fuzz tests (test_fuzz.py).

``draw_config(name, pick, n, h, d)`` returns the keyword arguments of one config of
mechanism ``name``, drawn through ``pick`` (a :class:`Pick`: hypothesis' ``data.draw`` in the
tests, ``random.Random`` in local campaigns). Values stay within each config's documented
ranges and include the edges: windows, blocks, chunks and landmark counts larger than the
sequence, global positions repeated, out of order, past the end and at the last position.
A mechanism without an entry here is drawn from its ``example`` spec alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Pick(Protocol):
    def int(self, lo: int, hi: int) -> int: ...
    def choice(self, options: Sequence[T]) -> T: ...
    def float(self, lo: float, hi: float) -> float: ...


class RandomPick:
    """A :class:`Pick` over ``random.Random`` (seeded campaigns outside hypothesis)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def float(self, lo: float, hi: float) -> float:
        return round(self.rng.uniform(lo, hi), 3)


def _positions(p: Pick, n: int, hi: int = 5) -> list[int]:
    """1..hi positions: duplicates, out of order, past the end, the last one."""
    return [p.choice([0, n - 1, n, p.int(0, n + 3)]) for _ in range(p.int(1, hi))]


def _size(p: Pick, n: int, lo: int = 1) -> int:
    """A size (window, block, chunk, landmarks): small, around n, or beyond n."""
    return p.choice([lo, lo + 1, p.int(lo, max(lo, n)), n + p.int(0, 3), p.int(lo, 80)])


def _divisor(p: Pick, h: int) -> int:
    return p.choice([g for g in range(1, h + 1) if h % g == 0])


Gen = Callable[[Pick, int, int, int], dict[str, Any]]
B = (False, True)

GENERATORS: dict[str, Gen] = {
    "adaptive_span": lambda p, n, h, d: dict(
        max_span=_size(p, n), ramp=p.int(1, 40), init=p.float(0.0, 1.0)),
    "average": lambda p, n, h, d: dict(ffn=p.choice(B), hidden=p.choice([None, 4, 16])),
    "axial": lambda p, n, h, d: dict(cols=_size(p, n), mode=p.choice(["union", "two_pass"])),
    "band": lambda p, n, h, d: dict(window=_size(p, n, 0)),
    "bigbird": lambda p, n, h, d: dict(
        block=_size(p, n), window_blocks=p.int(1, 5), num_random_blocks=p.int(0, 4),
        global_blocks=p.int(0, 3), seed=p.int(0, 3), last_global=p.choice(B)),
    "block_local": lambda p, n, h, d: dict(block=_size(p, n)),
    "bp_tree": lambda p, n, h, d: dict(window=p.int(0, 5), k=p.int(1, 4)),
    "camtl_prior": lambda p, n, h, d: (lambda t: dict(
        tasks=t, blocks=p.int(1, 6), task_dim=p.choice([4, 8]), task=p.int(0, t - 1)))(
        p.int(1, 4)),
    "capsule_routing": lambda p, n, h, d: dict(iterations=p.int(1, 4)),
    "clustered": lambda p, n, h, d: dict(
        clusters=_size(p, n), bits=p.int(1, 63), iterations=p.int(1, 5), seed=p.int(0, 3)),
    "collaborative": lambda p, n, h, d: dict(
        dk_shared=p.choice([None, h * d]),  # q arrives with Dk / d heads: h here
        mixing_init=p.choice(["normal", "concatenate", "ones"]), convert=p.choice(B)),
    # eps > 1: M + eps I is then nonsingular for any row-stochastic M (its eigenvalues lie in
    # the unit disk); below, an eigenvalue near -eps makes the solve ill-conditioned or
    # singular, the hazard CSALR's docstring states (a property of the method, not checked)
    "csalr": lambda p, n, h, d: dict(num_landmarks=_size(p, n), eps=p.float(1.05, 2.0)),
    "dilated": lambda p, n, h, d: dict(window=p.int(0, 12), dilation=p.int(1, 6)),
    "disagreement": lambda p, n, h, d: dict(
        terms=p.choice([("subspace",), ("position",), ("output",), ("position", "output"),
                        ("subspace", "position", "output")]), weight=p.float(0.0, 2.0)),
    "gaussian_transformer": lambda p, n, h, d: dict(
        w_init=p.float(0.01, 3.0), b_init=-p.float(0.01, 3.0)),
    "global_tokens": lambda p, n, h, d: dict(tokens=_positions(p, n)),
    "gqa": lambda p, n, h, d: dict(kv_heads=_divisor(p, h)),
    "hardcoded_gaussian": lambda p, n, h, d: dict(
        offsets=sorted({p.int(-3, 3) for _ in range(p.int(1, 3))}), sigma=p.float(0.3, 3.0)),
    "head_size": lambda p, n, h, d: dict(
        dk=p.choice([None, 1, d // 2, d, 2 * d]), dv=p.choice([None, 1, d // 2, d, 2 * d])),
    "improved_clustered": lambda p, n, h, d: dict(
        clusters=_size(p, n), bits=p.int(1, 63), iterations=p.int(1, 5), topk=_size(p, n),
        seed=p.int(0, 3)),
    "isab": lambda p, n, h, d: dict(num_inducing=_size(p, n)),
    "jat": lambda p, n, h, d: dict(
        rho=p.float(0.1, 8.0), coef=p.float(0.0, 1.0), order=p.int(1, 3), sign=p.choice(B),
        mask_pads=p.choice(B), mode=p.choice(["mix", "replace"]),
        variant=p.choice(["dense", "probsparse"]), factor=p.int(1, 6),
        adjacency=p.choice(["auto", "pairs", "enumerate", "compare", "direct", "naive"])),
    "lazyformer": lambda p, n, h, d: dict(share=p.int(1, 4), share_values=p.choice(B)),
    "linear": lambda p, n, h, d: dict(
        feature_map=p.choice(["elu", "relu"]), chunk=_size(p, n)),
    "linear_elu": lambda p, n, h, d: dict(chunk=_size(p, n)),
    "linear_relu": lambda p, n, h, d: dict(chunk=_size(p, n)),
    "linformer": lambda p, n, h, d: dict(
        k=_size(p, n), share=p.choice(["none", "kv", "headwise", "layerwise"])),
    "longformer": lambda p, n, h, d: dict(
        window=p.choice([0, 1, p.int(0, 12), n + 1]), global_tokens=_positions(p, n)),
    "lowrank_band": lambda p, n, h, d: dict(rank=p.int(1, 8), window=p.int(0, 12)),
    "lsh": lambda p, n, h, d: dict(
        buckets=p.choice([1, 2, 4, 6, 8, 16]), chunk=_size(p, n), num_hashes=p.int(1, 4),
        seed=p.int(0, 3), wrap=p.choice(B)),
    "luna": lambda p, n, h, d: dict(num_memory=_size(p, n)),
    "mca": lambda p, n, h, d: dict(
        compression=p.int(1, 6), local_block=p.int(0, 8), init=p.choice(["mean", "random"])),
    "mega": lambda p, n, h, d: dict(
        ndim=p.int(1, 6), zdim=p.choice([4, 8, 16]), chunk=p.choice([None, _size(p, n)]),
        attention_fn=p.choice(["softmax", "laplace"])),
    "multiscale": lambda p, n, h, d: p.choice([
        dict(windows=[p.choice([-1, 0, 1, p.int(0, 12)]) for _ in range(h)]),
        dict(scales=sorted({p.int(0, 12) for _ in range(p.int(1, 3))}) + p.choice([[], [-1]]),
             spread=p.int(1, 4))]),
    "nystrom": lambda p, n, h, d: dict(
        num_landmarks=_size(p, n), pinv_iterations=p.int(0, 8),
        conv_kernel=p.choice([0, 1, 3, 5]), pinv_init=p.choice(["original", "exact"])),
    "pattern_loss": lambda p, n, h, d: dict(patterns=[
        p.choice(["prev", "next", "first", "self", "bow", "none"]) for _ in range(p.int(1, h))],
        weight=p.float(0.0, 10.0)),
    "performer": lambda p, n, h, d: dict(
        num_features=p.int(1, 32), redraw=p.choice(["every_forward", "fixed"]),
        orthogonal=p.choice(B), seed=p.int(0, 3), chunk=_size(p, n)),
    "poolingformer": lambda p, n, h, d: dict(
        window=(w := p.int(0, 10)), window2=w + p.int(0, 30),
        pool=p.choice(["mean", "max", "conv"]),
        pool_size=(ps := p.int(1, 6)), stride=p.choice([None, p.int(1, ps)]),
        stacked=p.choice(B)),
    "predictive": lambda p, n, h, d: dict(alpha=p.float(0.0, 1.0), kernel=p.choice([1, 3, 5])),
    "probsparse": lambda p, n, h, d: dict(factor=p.int(1, 8), seed=p.int(0, 3)),
    "random": lambda p, n, h, d: dict(num_random=p.int(0, 12), seed=p.int(0, 3)),
    "routing": lambda p, n, h, d: dict(
        num_clusters=p.int(1, 8), window=p.choice([0, 1, p.int(0, 20), n + 2]),
        seed=p.int(0, 3)),
    "sac": lambda p, n, h, d: dict(k=_size(p, n), hidden=p.choice([4, 8])),
    "softmax": lambda p, n, h, d: dict(fused=p.choice(B)),
    "sparse_transformer": lambda p, n, h, d: (lambda s: dict(
        mode=p.choice(["strided", "fixed"]), stride=s, summary=p.int(1, s)))(_size(p, n)),
    "star": lambda p, n, h, d: dict(relay=p.choice([0, n - 1, n, p.int(0, n + 3)])),
    "synthesizer": lambda p, n, h, d: dict(
        kind=(kind := p.choice(["dense", "random"])), factorized=p.choice(B),
        a=p.choice([2, 7, 10]), rank=p.int(1, 8),  # a divides max_len (70)
        trainable=kind == "dense" or p.choice(B), mix=p.float(0.0, 1.0),
        learn_mix=p.choice(B)),
    "talking_heads": lambda p, n, h, d: dict(init=p.choice(["identity", "random"])),
}


def draw_config(name: str, pick: Pick, n: int, h: int, d: int) -> dict[str, Any] | None:
    """Keyword arguments of a random config of ``name`` (None: draw from its example)."""
    gen = GENERATORS.get(name)
    return None if gen is None else gen(pick, n, h, d)
