"""Generator of the built-in CoLA-format sample (``attnlab/data/cola_sample/{train,dev}.tsv``).

The sentences are written for this project from templates, not taken from CoLA. Each item is
an acceptable sentence built from a small grammar (people as subjects, transitive,
intransitive and ``put`` verbs, six tense/aspect frames, optional adjectives, adjuncts and
relative clauses) or an unacceptable variant made by one targeted edit:

- ``agreement``: subject-verb or determiner-noun number mismatch, including agreement with
  the noun inside a relative clause ("The teacher who admires the pilots *admire ...");
- ``order``: word-order scrambles that English never allows (noun before its determiner,
  adjective after the noun, object before a bare verb, auxiliary after the main verb);
- ``missing_arg``: an obligatorily transitive verb without object, ``put`` without a place;
- ``extra_arg``: an intransitive verb with a direct object;
- ``verb_form``: the wrong verb form after an auxiliary ("has find", "will found") or a
  bare participle as the finite verb ("The boy finding the key.").

Columns as in CoLA: source (``attn_<kind>``), label (1 acceptable, 0 not), original judgement
(``*`` or empty), sentence; no header. Deterministic for a given seed. Regenerate with::

    python -m attnlab.tasks.sample            # writes src/attnlab/data/cola_sample/
    python -m attnlab.tasks.sample --out DIR --seed 0 --train 400 --dev 150
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace
from pathlib import Path

# (singular, plural)
PEOPLE = [("teacher", "teachers"), ("child", "children"), ("farmer", "farmers"),
          ("student", "students"), ("doctor", "doctors"), ("girl", "girls"), ("boy", "boys"),
          ("woman", "women"), ("man", "men"), ("pilot", "pilots"), ("baker", "bakers"),
          ("neighbour", "neighbours"), ("singer", "singers"), ("lawyer", "lawyers"),
          ("nurse", "nurses"), ("painter", "painters")]
THINGS = [("book", "books"), ("letter", "letters"), ("apple", "apples"), ("cake", "cakes"),
          ("picture", "pictures"), ("key", "keys"), ("basket", "baskets"),
          ("umbrella", "umbrellas"), ("map", "maps"), ("lamp", "lamps"), ("coat", "coats"),
          ("box", "boxes"), ("ticket", "tickets"), ("parcel", "parcels")]
PERSON_ADJ = ["young", "tall", "quiet", "clever", "tired", "happy", "busy", "old"]
THING_ADJ = ["small", "red", "heavy", "new", "large", "old", "blue"]
# base, 3sg, past, participle, -ing
OBLIG_TRANS = [("find", "finds", "found", "found", "finding"),
               ("carry", "carries", "carried", "carried", "carrying"),
               ("bring", "brings", "brought", "brought", "bringing"),
               ("describe", "describes", "described", "described", "describing"),
               ("admire", "admires", "admired", "admired", "admiring"),
               ("borrow", "borrows", "borrowed", "borrowed", "borrowing"),
               ("lift", "lifts", "lifted", "lifted", "lifting"),
               ("mention", "mentions", "mentioned", "mentioned", "mentioning"),
               ("grab", "grabs", "grabbed", "grabbed", "grabbing"),
               ("examine", "examines", "examined", "examined", "examining"),
               ("take", "takes", "took", "taken", "taking")]
INTRANS = [("sleep", "sleeps", "slept", "slept", "sleeping"),
           ("arrive", "arrives", "arrived", "arrived", "arriving"),
           ("laugh", "laughs", "laughed", "laughed", "laughing"),
           ("smile", "smiles", "smiled", "smiled", "smiling"),
           ("sneeze", "sneezes", "sneezed", "sneezed", "sneezing"),
           ("yawn", "yawns", "yawned", "yawned", "yawning"),
           ("frown", "frowns", "frowned", "frowned", "frowning"),
           ("hesitate", "hesitates", "hesitated", "hesitated", "hesitating")]
PUT = ("put", "puts", "put", "put", "putting")
PLACES = ["on the table", "on the shelf", "in the box", "under the bed", "near the door",
          "in the drawer"]
ADJUNCTS = ["in the garden", "at the station", "near the river", "after lunch",
            "in the kitchen", "before dinner"]
DET_SG = ["the", "a", "this", "that", "my", "our"]
DET_PL = ["the", "these", "those", "my", "our", "some"]
NUMBER_DETS = {"this": "these", "that": "those", "these": "this", "those": "that"}
MODALS = ["will", "can", "should", "might"]
FRAMES = ["present", "past", "prog", "perfect", "modal", "question", "relative"]
KINDS = ["agreement", "order", "missing_arg", "extra_arg", "verb_form"]
B, S, PAST, PP, ING = range(5)


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class Clause:
    """An acceptable sentence's parts; ``realize`` turns it into words."""

    det: str
    adj: str | None
    noun: tuple[str, str]
    plural: bool
    frame: str
    verb: tuple[str, ...]
    kind: str  # trans | intrans | put
    obj: tuple[str, ...]
    loc: tuple[str, ...]
    adjunct: tuple[str, ...]
    aux_past: bool  # prog: was/were instead of is/are; question: did
    modal: str
    rel: tuple[str, ...] = ()  # relative clause words ("who admires the pilots")
    rel_plural: bool = False  # number of the noun inside the relative clause


def _np(rng: random.Random, nouns, adjs, plural: bool, dets_sg, dets_pl) -> list[str]:
    noun = rng.choice(nouns)[1 if plural else 0]
    adj = rng.choice(adjs) if rng.random() < 0.3 else None
    det = rng.choice(dets_pl if plural else dets_sg)
    first = adj or noun
    if det == "a":
        det = _a(first)
    return [det] + ([adj] if adj else []) + [noun]


def build(rng: random.Random) -> Clause:
    plural = rng.random() < 0.5
    det = rng.choice(DET_PL if plural else DET_SG)
    adj = rng.choice(PERSON_ADJ) if rng.random() < 0.3 else None
    kind = rng.choices(["trans", "intrans", "put"], weights=[6, 3, 1])[0]
    verb = {"trans": lambda: rng.choice(OBLIG_TRANS), "intrans": lambda: rng.choice(INTRANS),
            "put": lambda: PUT}[kind]()
    obj: tuple[str, ...] = ()
    loc: tuple[str, ...] = ()
    adjunct: tuple[str, ...] = ()
    if kind != "intrans":
        obj = tuple(_np(rng, THINGS, THING_ADJ, rng.random() < 0.3,
                        ["the", "a", "my", "her", "his", "this"], ["the", "some", "two", "her"]))
    if kind == "put":
        loc = tuple(rng.choice(PLACES).split())
    if kind == "intrans" or rng.random() < 0.2:
        adjunct = tuple(rng.choice(ADJUNCTS).split())
    frame = rng.choice(FRAMES)
    noun = rng.choice(PEOPLE)
    rel: tuple[str, ...] = ()
    rel_plural = False
    if frame == "relative":
        rel_plural = not plural  # the attractor differs in number from the head noun
        rverb = rng.choice(OBLIG_TRANS)
        others = [p for p in PEOPLE if p != noun]
        rnoun = _np(rng, others, PERSON_ADJ, rel_plural, ["the", "a"], ["the", "two"])
        rel = ("who", rverb[B] if plural else rverb[S], *rnoun)
    return Clause(det=det, adj=adj, noun=noun, plural=plural, frame=frame,
                  verb=verb, kind=kind, obj=obj, loc=loc, adjunct=adjunct,
                  aux_past=rng.random() < 0.4, modal=rng.choice(MODALS), rel=rel,
                  rel_plural=rel_plural)


def _fix_article(words: list[str]) -> list[str]:
    return [(_a(words[i + 1]) if w in ("a", "an") and i + 1 < len(words) else w)
            for i, w in enumerate(words)]


def realize(c: Clause, agree_plural: bool | None = None, vform: int | None = None
            ) -> tuple[list[str], list[str], list[str], str, list[str]]:
    """(subject, aux, verb, punctuation, rest) of a clause; ``agree_plural`` overrides the
    number the verb agrees with, ``vform`` the main verb's form."""
    pl = c.plural if agree_plural is None else agree_plural
    subj = _fix_article([c.det] + ([c.adj] if c.adj else []) + [c.noun[1 if c.plural else 0]])
    subj += list(c.rel)
    aux: list[str] = []
    form = {"present": S if not pl else B, "relative": S if not pl else B, "past": PAST,
            "prog": ING, "perfect": PP, "modal": B, "question": B}[c.frame]
    if c.frame == "prog":
        aux = [("were" if pl else "was") if c.aux_past else ("are" if pl else "is")]
    elif c.frame == "perfect":
        aux = ["have" if pl else "has"]
    elif c.frame == "modal":
        aux = [c.modal]
    elif c.frame == "question":
        aux = ["did" if c.aux_past else ("do" if pl else "does")]
    verb = [c.verb[form if vform is None else vform]]
    punct = "?" if c.frame == "question" else "."
    return subj, aux, verb, punct, list(c.obj) + list(c.loc) + list(c.adjunct)


def sentence(c: Clause, **kw) -> list[str]:
    subj, aux, verb, punct, rest = realize(c, **kw)
    if c.frame == "question":
        return aux + subj + verb + rest + [punct]
    return subj + aux + verb + rest + [punct]


def corrupt(c: Clause, kind: str, rng: random.Random) -> list[str] | None:
    """An unacceptable variant of ``c`` by one edit of type ``kind`` (None: not applicable)."""
    if kind == "agreement":
        if c.frame in ("present", "relative", "prog", "perfect") or (
                c.frame == "question" and not c.aux_past):
            # (in a relative frame this is agreement with the attractor noun)
            return sentence(c, agree_plural=not c.plural)
        if c.det in NUMBER_DETS:  # "these teacher", "a teachers"
            return sentence(replace(c, det=NUMBER_DETS[c.det]))
        return None
    if kind == "order":
        subj, aux, verb, punct, rest = realize(c)
        ops = ["det_noun"]
        if c.adj:
            ops.append("adj_noun")
        if c.obj and not aux and c.frame != "relative":
            ops.append("obj_verb")
        if aux and c.frame != "question":
            ops.append("aux_after")
        op = rng.choice(ops)
        if op == "det_noun":
            subj = subj[1:2] + subj[:1] + subj[2:]
        elif op == "adj_noun":
            subj = [subj[0], subj[2], subj[1]] + subj[3:]
        elif op == "obj_verb":
            n_obj = len(c.obj)
            return subj + rest[:n_obj] + verb + rest[n_obj:] + [punct]
        else:
            return subj + verb + aux + rest + [punct]
        return (aux + subj + verb + rest if c.frame == "question" else
                subj + aux + verb + rest) + [punct]
    if kind == "missing_arg":
        if c.kind == "trans" and not c.adjunct:
            return sentence(replace(c, obj=()))
        if c.kind == "put" and not c.adjunct:  # an adjunct would read as the place
            return sentence(replace(c, loc=()))
        return None
    if kind == "extra_arg":
        if c.kind != "intrans":
            return None
        obj = tuple(_np(rng, THINGS, THING_ADJ, False, ["the", "a", "my"], ["the"]))
        return sentence(replace(c, obj=obj))
    if kind == "verb_form":
        right = realize(c)[2][0]  # the verb form the frame needs
        wrong = {"prog": [B, S], "perfect": [B, S, ING], "modal": [S, PAST, ING],
                 "question": [S, PAST, ING]}.get(c.frame, [ING])
        choices = [f for f in wrong if c.verb[f] != right]
        return sentence(c, vform=rng.choice(choices)) if choices else None
    raise ValueError(f"unknown corruption {kind!r}")


def generate(n: int, seed: int = 0, p_ok: float = 0.55) -> list[tuple[str, int, str]]:
    """``n`` distinct ``(source, label, sentence)`` items, deterministic for ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, int, str]] = []
    while len(out) < n:
        c = build(rng)
        words, label, kind = sentence(c), 1, "ok"
        if rng.random() >= p_ok:  # the first applicable corruption in a random order
            for kind in rng.sample(KINDS, len(KINDS)):
                bad = corrupt(c, kind, rng)
                if bad is not None:
                    words, label = bad, 0
                    break
        text = " ".join(words[:-1]) + words[-1]
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            out.append((f"attn_{kind}", label, text))
    return out


def write_sample(out_dir: Path, seed: int = 0, n_train: int = 400, n_dev: int = 150) -> None:
    items = generate(n_train + n_dev, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", items[:n_train]), ("dev", items[n_train:])):
        with open(out_dir / f"{name}.tsv", "w", encoding="utf-8", newline="\n") as fh:
            for source, label, text in rows:
                fh.write(f"{source}\t{label}\t{'' if label else '*'}\t{text}\n")


def main(argv: list[str] | None = None) -> None:
    default = Path(__file__).resolve().parents[1] / "data" / "cola_sample"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=default)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--dev", type=int, default=150)
    args = ap.parse_args(argv)
    write_sample(args.out, args.seed, args.train, args.dev)
    print(f"wrote {args.train} train / {args.dev} dev sentences to {args.out}")


if __name__ == "__main__":
    main()
