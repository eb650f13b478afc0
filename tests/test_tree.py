"""Tree appending, pruning and fixed-width selection against brute-force path references."""

import random

import torch

from stages.speculation.tree import Level, SpecTree, fixed_width_level


def paths_of(tree: SpecTree) -> list[tuple[int, ...]]:
    return [tuple(tree.path_tokens(i)) for i in range(len(tree))]


def check_invariants(tree: SpecTree, ref: list[tuple[int, ...]]) -> None:
    # tokens and paths equal the reference, in BFS order
    assert paths_of(tree) == ref
    assert tree.tokens.tolist() == [p[-1] for p in ref]
    assert tree.depth.tolist() == [len(p) - 1 for p in ref]
    assert tree.depth.tolist() == sorted(tree.depth.tolist())
    assert tree.ids.tolist() == sorted(tree.ids.tolist())
    n = len(ref)
    for i in range(n):
        for j in range(n):
            is_anc = len(ref[j]) <= len(ref[i]) and ref[i][: len(ref[j])] == ref[j]
            assert bool(tree.mask[i, j]) == is_anc, (i, j)
    # parents sorted within a level (layer appending sorts by parent)
    for d in range(tree.height + 1):
        lvl = tree.level(d)
        assert tree.parent[lvl].tolist() == sorted(tree.parent[lvl].tolist())


def random_level(tree: SpecTree, rng: random.Random, vocab: int = 7) -> Level:
    bottom = tree.level(tree.height).tolist()
    parents, tokens = [], []
    for p in bottom:
        for t in rng.sample(range(vocab), rng.randint(0, 3)):
            parents.append(p)
            tokens.append(t)
    order = list(range(len(parents)))
    rng.shuffle(order)  # appending must sort by parent itself
    return Level(torch.tensor([parents[i] for i in order], dtype=torch.long),
                 torch.tensor([tokens[i] for i in order], dtype=torch.long),
                 torch.rand(len(order), dtype=torch.float64))


def test_append_and_prune_match_bruteforce():
    rng = random.Random(0)
    for _ in range(60):
        tree = SpecTree(rng.randrange(7), root_pos=5)
        ref = [(tree.root_token,)]
        for _ in range(rng.randint(1, 4)):
            level = random_level(tree, rng)
            if not len(level):
                break
            pairs = sorted(zip(level.parents.tolist(), level.tokens.tolist(), strict=True),
                           key=lambda x: x[0])
            tree.append_level(level)
            ref = ref + [ref[p] + (t,) for p, t in pairs]
            check_invariants(tree, ref)
        if len(tree) == 1:
            continue
        node = rng.randrange(1, len(tree))
        base = ref[node]
        old_pos, old_depth = tree.root_pos, int(tree.depth[node])
        old_cum = tree.cum.clone()
        kept_ids = [int(tree.ids[i]) for i in range(len(ref)) if ref[i][: len(base)] == base]
        tree.prune_to(node)
        ref = [(base[-1],) + p[len(base):] for p in ref if p[: len(base)] == base]
        check_invariants(tree, ref)
        assert tree.ids.tolist() == kept_ids
        assert tree.root_pos == old_pos + old_depth
        assert tree.parent[0] == -1 and tree.probs[0] == 1.0
        assert torch.allclose(tree.cum[0], torch.tensor(1.0, dtype=torch.float64))
        assert old_cum.numel() >= tree.cum.numel()


def test_fixed_width_keeps_top_cumulative():
    rng = random.Random(1)
    for _ in range(40):
        tree = SpecTree(0, 0)
        tree.append_level(Level(torch.zeros(4, dtype=torch.long), torch.arange(1, 5),
                                torch.rand(4, dtype=torch.float64)))
        bottom = tree.level(1)
        toks = [torch.tensor(rng.sample(range(50), 3)) for _ in bottom]
        probs = [torch.rand(3, dtype=torch.float64) for _ in bottom]
        w = rng.randint(1, 14)
        level = fixed_width_level(tree, bottom, toks, probs, w)
        cands = [(float(tree.cum[p] * pr), int(p), int(t))
                 for p, ts, ps in zip(bottom.tolist(), toks, probs, strict=True)
                 for t, pr in zip(ts.tolist(), ps, strict=True)]
        best = sorted(cands, key=lambda c: -c[0])[:w]
        assert len(level) == min(w, 12)
        assert sorted(zip(level.parents.tolist(), level.tokens.tolist(), strict=True)) == \
            sorted((p, t) for _, p, t in best)
        tree.append_level(level)
        assert (tree.depth == 2).sum() <= w


def test_child_lookup_and_index_of():
    tree = SpecTree(9, 3)
    tree.append_level(Level(torch.tensor([0, 0]), torch.tensor([4, 5]),
                            torch.tensor([0.6, 0.4], dtype=torch.float64)))
    assert tree.child_with_token(0, 5) == 2
    assert tree.child_with_token(0, 6) is None
    assert tree.index_of(tree.ids[[2, 0]]).tolist() == [2, 0]
    assert tree.positions(torch.tensor([0, 1])).tolist() == [3, 4]
