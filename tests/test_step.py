"""The step core: verdicts, verdict application, next-level growth, owner and mirrors."""

from __future__ import annotations

import random

import torch
from torch import Tensor

from protocol.sync.control import Verdict
from stages.speculation.step import Mirror, TreeOwner, apply_verdict, decide, next_level
from stages.speculation.token_sources import Proposals, TokenSource
from stages.speculation.tree import Level, SpecTree, new_ids


class CountingSource(TokenSource):
    """Proposes (token + 1 .. token + k) mod 11 with falling probabilities; records syncs."""

    name = "counting"

    def __init__(self) -> None:
        self.synced: list[list[int]] = []

    def reset(self, prompt: list[int]) -> None:
        self.synced = []

    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int,
               allowed: Tensor | None = None) -> Proposals:
        assert committed[-1] == tree.root_token  # the contract: committed ends with the root
        toks = [(tree.tokens[i] + torch.arange(1, k + 1)) % 11 for i in idx.tolist()]
        probs = [torch.linspace(0.6, 0.1, k, dtype=torch.float64) for _ in idx.tolist()]
        return toks, probs

    def sync(self, tree: SpecTree, committed_ids: list[int]) -> None:
        self.synced.append(list(committed_ids))


class RecordingCache:
    """Stands in for a StageCache: records what pruning propagation asks of it."""

    def __init__(self) -> None:
        self.kept: list[list[int]] = []
        self.promoted: list[int] = []

    def keep(self, alive: Tensor) -> None:
        self.kept.append(alive.tolist())

    def promote(self, node_id: int) -> None:
        self.promoted.append(node_id)


def _tree() -> SpecTree:
    tree = SpecTree(9, 10)
    tree.append_level(Level(torch.zeros(3, dtype=torch.long), torch.tensor([3, 5, 7]),
                            torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)))
    tree.append_level(Level(torch.tensor([1, 2]), torch.tensor([4, 6]),
                            torch.tensor([0.9, 0.8], dtype=torch.float64)))
    return tree


def test_decide_names_the_child_or_the_new_root() -> None:
    tree = _tree()
    assert decide(tree, 5, 99) == Verdict(5, int(tree.ids[2]), 99)
    v = decide(tree, 8, 99)
    assert v == Verdict(8, -1, 99) and v.miss and not v.hit
    assert decide(tree, 4, 99).miss  # a grandchild's token is no hit


def test_apply_verdict_hit_miss_none_and_unseen_child() -> None:
    tree = _tree()
    old_root, child = tree.root_id, int(tree.ids[1])
    same, verified = apply_verdict(tree, Verdict(-1, -1, 50))
    assert same is tree and verified is None and len(tree) == 6
    pruned, verified = apply_verdict(tree, Verdict(3, child, 50))
    assert verified == old_root and pruned.root_id == child and pruned.root_pos == 11
    assert pruned.tokens.tolist() == [3, 4] and pruned.depth.tolist() == [0, 1]
    fresh, verified = apply_verdict(pruned, Verdict(8, -1, 50))
    assert verified == child and (fresh.root_id, fresh.root_token, fresh.root_pos) == (50, 8, 12)
    assert len(fresh) == 1
    # a hit on a node this mirror has not received yet: the child becomes a lone root
    lone, _ = apply_verdict(fresh, Verdict(2, 77, 60))
    assert (lone.root_id, lone.root_token, len(lone)) == (77, 2, 1)


def test_next_level_waits_for_proposals_of_the_whole_bottom() -> None:
    tree = _tree()
    bottom = tree.ids[tree.level(2)].tolist()
    props = {bottom[0]: (torch.tensor([1, 2]), torch.tensor([0.5, 0.4], dtype=torch.float64))}
    assert len(next_level(tree, props, 4)) == 0
    props[bottom[1]] = (torch.tensor([3]), torch.tensor([0.9], dtype=torch.float64))
    level = next_level(tree, props, 2)
    # cumulative 0.3*0.9*{0.5, 0.4} = {0.135, 0.108} vs 0.2*0.8*0.9 = 0.144: the best
    # child of each parent, in (parent, rank) order
    assert level.tokens.tolist() == [1, 3] and level.parents.tolist() == [4, 5]


def test_owner_grows_prunes_proposals_and_syncs_the_source() -> None:
    src = CountingSource()
    owner = TreeOwner(src, width=3, topk=2, committed=[1, 2])
    root = owner.start(4)
    assert owner.committed == [1, 2, 4] and owner.tree is not None
    owner.propose(root)
    level = owner.grow(None)
    assert owner.tree.tokens[level].tolist() == [5, 6]
    owner.propose(level)
    assert len(owner.grow(None)) == 3  # width 3 of the 4 grandchildren
    assert owner.root_children() == [(5, int(owner.tree.ids[1])), (6, int(owner.tree.ids[2]))]
    old_root = owner.tree.root_id
    v = owner.decide(6)
    assert v.hit
    assert owner.apply(v) == old_root
    assert owner.committed == [1, 2, 4, 6] and src.synced == [[old_root]]
    assert set(owner.proposals) <= set(owner.tree.ids.tolist())  # dead proposals dropped
    assert owner.tree.height == 1 and len(owner.grow(v)) == 0  # kept level not proposed yet
    owner.propose(owner.tree.level(1))
    kept = owner.tree.tokens[owner.tree.level(1)].tolist()
    grown = owner.grow(v)  # (indexing after: growing replaces the tree's tensors)
    assert owner.tree.tokens[grown].tolist() == [(t + d) % 11 for t in kept for d in (1, 2)][:3]
    miss = owner.decide(0, new_root=500)
    assert miss.miss and owner.apply(miss) is not None
    assert owner.tree.root_id == 500 and owner.grow(miss).tolist() == [0]  # new root re-enters
    assert owner.proposals == {}


def test_owner_without_source_is_pp() -> None:
    owner = TreeOwner(None, width=8, topk=4, committed=[1])
    owner.propose(owner.start(2))  # nothing to propose with
    assert owner.grow(None).numel() == 0
    v = owner.decide(3, new_root=40)
    assert v.miss and owner.apply(v) is not None and owner.grow(v).tolist() == [0]


def test_mirrors_follow_the_owner_at_any_lag() -> None:
    """Stage s sees each level s steps after the owner sent it; its mirror must hold
    exactly the owner's nodes it has received (same ids, tokens, depths)."""
    rng = random.Random(3)
    seen: set[str] = set()
    for lag in (0, 1, 2):
        src = CountingSource()
        owner = TreeOwner(src, width=4, topk=3, committed=[1])
        first = int(new_ids(1)[0])  # the owner reserves root ids like any node id
        new = owner.start(7, root_id=first)
        cache = RecordingCache()
        mirror = Mirror(cache)  # type: ignore[arg-type]
        mirror.start(7, 1, first)
        sent: list[tuple[Tensor, Tensor, Tensor]] = []
        verdict: Verdict | None = None
        for step in range(40):
            tree = owner.tree
            assert tree is not None
            par = tree.parent[new]
            pids = torch.where(par >= 0, tree.ids[par.clamp(min=0)], torch.full_like(par, -1))
            sent.append((tree.ids[new], pids, tree.tokens[new]))
            owner.propose(new)
            if step >= lag:  # the level sent `lag` steps ago reaches the mirror now
                ids, parents, tokens = sent[step - lag]
                keep = mirror.alive(ids, parents)
                mirror.append(ids[keep], parents[keep], tokens[keep])
                got = mirror.tree
                assert got is not None
                common = torch.isin(tree.ids, got.ids)
                assert torch.equal(tree.ids[common], got.ids)
                assert torch.equal(tree.tokens[common], got.tokens)
                assert torch.equal(tree.depth[common], got.depth)
            # the verdict: a hit on a random root child, a miss, or nothing verified
            r = rng.random()
            kids = owner.root_children()
            reserved = int(new_ids(1)[0])
            if r < 0.2:
                verdict = Verdict(-1, -1, reserved)
            elif r < 0.75 and kids:
                verdict = owner.decide(rng.choice(kids)[0], new_root=reserved)
            else:
                verdict = owner.decide(10, new_root=reserved)  # 10 is never proposed
            if verdict.hit:
                seen.add("hit" if mirror.tree.has(verdict.child) else "hit on an unseen node")
            else:
                seen.add("miss" if verdict.miss else "nothing verified")
            verified = owner.apply(verdict)
            assert mirror.apply(verdict) == verified
            if verified is not None:
                assert cache.promoted[-1] == verified
                assert cache.kept[-1] == [verified, *mirror.tree.ids.tolist()]
                assert mirror.tree.root_id == owner.tree.root_id
                assert mirror.tree.root_pos == owner.tree.root_pos
            new = owner.grow(verdict)
    # every kind of verdict was applied, a hit on a node still on its way down too
    assert seen == {"hit", "hit on an unseen node", "miss", "nothing verified"}
