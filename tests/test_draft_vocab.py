"""Reduced draft vocabulary (FR-Spec): lossless, exact with the full vocabulary, never
outside its subset; ``treepipe draft vocab`` and ``--draft-vocab`` errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from orchestrator.cli.main import main
from orchestrator.lab.drafting.vocab import frequency_order
from orchestrator.models.draft_vocab import read_vocab, write_vocab
from protocol.errors import TreepipeError
from stages.model.model import ModelArgs
from stages.model.sampling import SamplingParams
from stages.speculation.batch import Request, generate_many
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, HybridSource, expand_packed
from stages.speculation.tree import Level, SpecTree
from tests.tiny_models import (
    PROMPT,
    TARGET,
    other_draft,
    save_byte_level_model,
    target_shards,
    target_whole,
)

N_NEW = 24
SAMPLINGS = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11),
}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    eng = PipelineEngine([target_whole()])
    return {n: eng.generate(PROMPT, N_NEW, sp, "ar").tokens for n, sp in SAMPLINGS.items()}


def subset(reference: dict[str, list[int]]) -> torch.Tensor:
    """Half the vocabulary: most of the target's tokens but not all (misses from the cut)."""
    seen = list(dict.fromkeys(reference["greedy"] + reference["sampled"]))
    dropped = set(seen[1::4])
    keep = [t for t in seen if t not in dropped]
    keep += [t for t in range(TARGET.vocab_size) if t not in set(seen)]
    return torch.tensor(keep[:TARGET.vocab_size // 2], dtype=torch.long)


def reduced_source(name: str, ids: torch.Tensor) -> DraftModelSource | HybridSource:
    draft = DraftModelSource(target_whole() if name == "self-draft" else other_draft())
    draft.reduce_vocab(ids)
    return HybridSource(draft) if name == "hybrid" else draft


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("method", ["specpipe", "specinfer"])
@pytest.mark.parametrize("name", ["self-draft", "hybrid"])
@pytest.mark.parametrize("m,w,k", [(1, 4, 2), (3, 8, 4)])
def test_reduced_head_is_lossless(reference, sampling, method, name, m, w, k):
    ids = subset(reference)
    assert set(reference[sampling]) - set(ids.tolist())  # some target tokens are never proposed
    out = PipelineEngine(target_shards(m), reduced_source(name, ids), width=w, topk=k).generate(
        PROMPT, N_NEW, SAMPLINGS[sampling], method)
    assert out.tokens == reference[sampling]
    if name == "self-draft" and m > 1:  # one stage: nothing is in flight to hit
        assert sum(s.hits for s in out.steps) > 0  # the hit path ran, not only refills


def test_reduced_head_is_lossless_batched(reference):
    """The packed draft forward of SpecPipe-DB (expand_packed) with a reduced head."""
    ids = subset(reference)
    eng = PipelineEngine(target_shards(2), reduced_source("self-draft", ids), width=4, topk=2)
    reqs = [Request(PROMPT, N_NEW, sp) for sp in SAMPLINGS.values()] + \
        [Request(PROMPT[5:], 12, SamplingParams())]
    outs = generate_many(eng, reqs, max_batch=3)
    assert [o.tokens for o in outs[:2]] == [reference["greedy"], reference["sampled"]]
    alone = PipelineEngine([target_whole()]).generate(PROMPT[5:], 12, SamplingParams(), "ar")
    assert outs[2].tokens == alone.tokens


def _level(tree: SpecTree, draft: DraftModelSource, committed: list[int], k: int
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Proposals for the root, then for a level of its children."""
    t0, p0 = draft.expand(tree, torch.zeros(1, dtype=torch.long), committed, k)
    idx = tree.append_level(Level(torch.zeros(len(t0[0]), dtype=torch.long), t0[0], p0[0]))
    t1, p1 = draft.expand(tree, idx, committed, k)
    return t0 + t1, p0 + p1


def test_full_vocabulary_in_frequency_order_proposes_what_the_full_head_does():
    perm = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(3))
    full, red = DraftModelSource(target_whole()), DraftModelSource(target_whole())
    red.reduce_vocab(perm)
    out = []
    for d in (full, red):
        d.reset(PROMPT[:-1])
        out.append(_level(SpecTree(PROMPT[-1], len(PROMPT) - 1), d, PROMPT, 8))
    for (tf, pf), (tr, pr) in zip(zip(*out[0], strict=True), zip(*out[1], strict=True),
                                  strict=True):
        assert tf.tolist() == tr.tolist()
        torch.testing.assert_close(pf, pr)


def test_reduced_head_never_proposes_outside_its_subset():
    ids = torch.tensor([5, 40, 2, 63, 17], dtype=torch.long)
    shard = other_draft()
    pool = shard.new_pool(8, growable=True)
    drafts = [DraftModelSource(shard, pool=pool) for _ in range(2)]
    drafts[0].reduce_vocab(ids)
    drafts[1].head = drafts[0].head  # packing needs one head object (as fresh_source copies)
    trees = []
    for j, d in enumerate(drafts):
        d.reset(PROMPT[j:-1])
        trees.append(SpecTree(PROMPT[-1], len(PROMPT) - 1 - j))
    roots = [torch.zeros(1, dtype=torch.long)] * 2
    for toks, probs in expand_packed(drafts, trees, roots, 16):  # k > K: at most K come back
        assert set(toks[0].tolist()) == set(ids.tolist())
        assert float(probs[0].sum()) == pytest.approx(1.0)  # renormalised over the subset
        assert probs[0].tolist() == sorted(probs[0].tolist(), reverse=True)
    with pytest.raises(ValueError, match="LM head"):
        drafts[1].head = None
        expand_packed(drafts, trees, roots, 4)


def test_frequency_order_ties_and_fill():
    ids, counts = frequency_order(Counter({7: 3, 2: 3, 9: 5, 1: 1}), 12, 8)
    assert ids == [9, 2, 7, 1, 0, 3, 4, 5] and counts == [5, 3, 3, 1, 0, 0, 0, 0]


# ---- files, flags and the command on a tiny checkpoint ------------------------------------------

BYTE_ARGS = ModelArgs(vocab_size=256, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                      intermediate_size=64, max_seq_len=256)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Llama with a byte-level tokenizer, as a Hugging Face folder."""
    return save_byte_level_model(tmp_path_factory.mktemp("tiny-vocab-model"), BYTE_ARGS)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab-prompts") / "p.jsonl"
    rows = [{"prompt": "def add(a, b):\n    return a + b\n"}, {"prompt": "abcabc abc"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_vocab_command_orders_ids_by_frequency(tiny_folder, prompts_file, tmp_path, capsys):
    out = tmp_path / "vocab.json"
    rc = main(["draft", "vocab", "--model", str(tiny_folder), "--prompts", str(prompts_file),
               "--max-new-tokens", "12", "--size", "100", "--no-count-prompts", "--threads", "1",
               "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["kind"] == "treepipe-draft-vocab" and doc["size"] == 100 == len(doc["ids"])
    assert not doc["count_prompts"] and doc["n_prompts"] == 2
    # the counts are the target's greedy output tokens (EOS: none in a byte tokenizer)
    from stages.model.checkpoint import load_shard
    from stages.model.tokenizer import TextTokenizer
    tok = TextTokenizer.from_folder(tiny_folder)
    eng = PipelineEngine([load_shard(tiny_folder, 0, BYTE_ARGS.n_layers, torch.float32, "cpu")])
    expect: Counter[int] = Counter()
    for text in ("def add(a, b):\n    return a + b\n", "abcabc abc"):
        expect.update(eng.generate(tok.encode(text), 12, SamplingParams(), "ar").tokens)
    assert doc["output_tokens"] == sum(expect.values()) == sum(doc["counts"])
    assert dict(zip(doc["ids"], doc["counts"], strict=True)) == \
        {t: expect.get(t, 0) for t in doc["ids"]}
    assert doc["counts"] == sorted(doc["counts"], reverse=True)
    assert len(set(doc["ids"])) == 100
    # and it drives --draft-vocab: top-k hit ratios with and without the reduced head
    rc = main(["draft", "eval", "--target", str(tiny_folder), "--draft", "layers:2",
               "--draft-vocab", f"{out}:40", "--prompts", str(prompts_file),
               "--max-new-tokens", "8", "--ks", "1,4", "--threads", "1",
               "--cache", str(tmp_path / "truth.json"), "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["draft_vocab_size"] == 40 and set(rep["full_head"]["topk_hit"]) == {"1", "4"}
    assert rep["level"][0]["draft_ms_per_level"] > 0
    assert rep["full_head"]["level"][0]["draft_ms_per_level"] > 0
    assert rep["flops"]["draft_head_mflops"] < rep["full_head"]["flops"]["draft_head_mflops"]


def test_read_vocab_errors(tmp_path):
    f = tmp_path / "v.json"
    write_vocab(f, [3, 1, 2], [5, 4, 1], {"model": "tiny"})
    assert read_vocab(f"{f}:2", 8).tolist() == [3, 1]
    assert read_vocab(str(f), 8).tolist() == [3, 1, 2]
    for flag, msg in [(str(tmp_path / "missing.json"), "not found"), (f"{f}:0", "1 or more"),
                      (f"{f}:4", "fewer than K=4")]:
        with pytest.raises(TreepipeError, match=msg):
            read_vocab(flag, 8)
    with pytest.raises(TreepipeError, match="outside the draft's vocabulary of 3"):
        read_vocab(str(f), 3)
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(TreepipeError, match="not a draft vocabulary"):
        read_vocab(str(tmp_path / "junk.json"), 8)


@pytest.mark.parametrize("argv,msg", [
    (["--draft", "layers:2", "--draft-vocab", "{d}/missing.json"], "not found"),
    (["--draft", "layers:2", "--draft-vocab", "{d}/vocab.json:0"], "K must be 1 or more"),
    (["--draft", "layers:2", "--draft-vocab", "{d}/big.json"], "outside the draft's vocabulary"),
    (["--draft", "ngram", "--draft-vocab", "{d}/vocab.json"], "needs a draft model"),
])
def test_bad_draft_vocab_is_one_line(tiny_folder, tmp_path, capsys, argv, msg):
    write_vocab(tmp_path / "vocab.json", [1, 2], [2, 1], {})
    write_vocab(tmp_path / "big.json", [1, 999], [2, 1], {})
    argv = [x.format(d=tmp_path) for x in argv]
    rc = main(["draft", "eval", "--target", str(tiny_folder), *argv, "--prompts", "humaneval:1",
               "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_vocab_command_bad_size_is_one_line(tiny_folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["draft", "vocab", "--model", str(tiny_folder), "--size", "0", "--out",
              str(tmp_path / "v.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "--size" in err
    rc = main(["draft", "vocab", "--model", str(tiny_folder), "--size", "999", "--prompts",
               "humaneval:1", "--out", str(tmp_path / "v.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "larger than the model's vocabulary" in err
    assert len(err.strip().splitlines()) == 1, err
