"""CLI on the real model: JSON output, streaming, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from orchestrator.cli.main import main
from stages.model.execution_modes import resolve_dtype
from stages.model.model import ModelArgs, random_shards
from stages.speculation.engine import ConfigError, PipelineEngine
from stages.speculation.token_sources import DraftModelSource
from tests.tiny_models import TARGET, target_shards


def treepipe(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *argv],
                          capture_output=True, text=True, timeout=300)


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess:
    """``treepipe ARGV`` through ``main()`` itself, in this process (a process each would
    add a torch import apiece), as a finished process: exit status and stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out.out, out.err)


def assert_one_line_error(cp: subprocess.CompletedProcess, *needles: str) -> None:
    assert cp.returncode != 0
    assert "Traceback" not in cp.stderr
    lines = [ln for ln in cp.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, cp.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_generate_json_matches_ar(smollm2_path):
    common = ["--model", str(smollm2_path), "--stages", "4", "--max-new-tokens", "12",
              "--prompt", "def fibonacci(n):", "--ignore-eos", "--json"]
    sp = treepipe("generate", "--method", "specpipe", "--draft", "ngram", "--width", "16",
                  "--topk", "8", *common)
    ar = treepipe("generate", "--method", "ar", *common)
    assert sp.returncode == 0 and ar.returncode == 0, sp.stderr + ar.stderr
    a, b = json.loads(sp.stdout), json.loads(ar.stdout)
    for key in ("method", "stages", "width", "topk", "tokens", "text", "steps",
                "tokens_per_step", "hit_rate", "flushes", "wall_s", "pipelined_s"):
        assert key in a, key
    assert a["method"] == "specpipe" and a["stages"] == 4 and len(a["tokens"]) == 12
    assert a["dtype"] == resolve_dtype("auto", "cpu") and a["execution"] == "tuned"
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]


def test_generate_streams_text_and_stats(smollm2_path):
    cp = treepipe("generate", "--model", str(smollm2_path), "--stages", "2", "--chat",
                  "--max-new-tokens", "16", "--prompt", "What is the capital of France?")
    assert cp.returncode == 0, cp.stderr
    assert "Paris" in cp.stdout
    stats = cp.stdout.strip().splitlines()[-3:]
    # the dtype and execution mode that ran: auto's on this CPU
    assert "tok/step" in stats[0] and f"{resolve_dtype('auto', 'cpu')} tuned]" in stats[0]
    assert "TBT wall clock" in stats[1] and "measured" in stats[1]
    assert "TBT pipelined" in stats[2] and "modelled" in stats[2]


@pytest.mark.parametrize("argv,needles", [
    (["--model", "no-such-model"], ["no-such-model", "known model"]),
    (["--stages", "31"], ["--stages 31", "30 layers"]),
    (["--width", "0"], ["--width", "1 or more"]),
    (["--topk", "-2"], ["--topk", "1 or more"]),
    (["--temperature", "-1"], ["temperature", ">= 0"]),
    (["--device", "tpu"], ["tpu", "--device"]),
    (["--draft", "layers:99"], ["layers:99", "layer count"]),
])
def test_bad_flags_get_one_line_errors(smollm2_path, argv, needles, capsys):
    """In process; the first case also as its own process, exit status and all."""
    common = ["generate", "--model", str(smollm2_path), "--prompt", "hi",
              "--max-new-tokens", "2", *argv]
    assert_one_line_error(in_process(capsys, *common), *needles)
    if argv[0] == "--model":
        assert_one_line_error(treepipe(*common), *needles)


def test_prompt_longer_than_context(smollm2_path, capsys):
    cp = in_process(capsys, "generate", "--model", str(smollm2_path), "--prompt", "word " * 9000,
                  "--max-new-tokens", "8")
    assert_one_line_error(cp, "exceeds the model's context", "shorten the prompt")


def test_draft_with_other_vocabulary_is_refused():
    bad = ModelArgs(vocab_size=TARGET.vocab_size + 1, dim=16, n_layers=1, n_heads=2,
                    n_kv_heads=1, intermediate_size=32)
    draft = DraftModelSource(random_shards(bad, [(0, 1)], seed=1)[0])
    with pytest.raises(ConfigError, match="vocabulary"):
        PipelineEngine(target_shards(2), draft)


def test_engine_rejects_bad_tree_shape():
    with pytest.raises(ConfigError, match="width"):
        PipelineEngine(target_shards(2), None, width=0)
    with pytest.raises(ConfigError, match="top-k"):
        PipelineEngine(target_shards(2), None, topk=0)


def test_cli_refuses_draft_folder_with_other_vocabulary(smollm2_path, tmp_path, capsys):
    from stages.model.checkpoint import save_checkpoint

    bad = ModelArgs(vocab_size=1000, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                    intermediate_size=32)
    shard = random_shards(bad, [(0, 1)], seed=1)[0]
    state = {hf: shard.state_dict()[name] for hf, name in shard.checkpoint_keys().items()}
    save_checkpoint(tmp_path / "draft", bad, state)
    cp = in_process(capsys, "generate", "--model", str(smollm2_path), "--prompt", "hi",
                    "--stages", "2", "--draft", str(tmp_path / "draft"), "--max-new-tokens", "2")
    assert_one_line_error(cp, "vocabulary has 1000 tokens", "49152")


def test_model_random_writes_a_loadable_model(tmp_path):
    out = tmp_path / "rand"
    cp = treepipe("model", "random", "--shape", "llama-3.2-1b", "--layers", "1", "--vocab",
                  "300", "--out", str(out))
    assert cp.returncode == 0, cp.stderr
    from stages.model.checkpoint import load_model_args
    from stages.model.tokenizer import TextTokenizer
    args = load_model_args(out)
    assert (args.n_layers, args.dim, args.n_kv_heads, args.vocab_size) == (1, 2048, 8, 300)
    tok = TextTokenizer.from_folder(out)
    ids = tok.encode("hé")
    assert len(ids) == 3 and max(ids) < 256 and tok.decode(ids) == "hé"  # one token per byte


def test_model_random_refuses_a_vocabulary_below_the_bytes(tmp_path):
    cp = treepipe("model", "random", "--shape", "smollm2-135m", "--vocab", "64", "--out",
                  str(tmp_path / "x"))
    assert_one_line_error(cp, "--vocab 256")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["top"], ["bench-serve"],
                                     ["gateway"], ["serve", "m"]])
def test_a_secret_on_the_command_line_is_refused_unechoed(command, capsys):
    """``--api-key SECRET`` (which argparse would read as ``--api-key-file SECRET``, printing
    the secret in the error) is refused by every command that takes ``--api-key-file``."""
    cp = in_process(capsys, *command, "--api-key", "sk-do-not-print")
    assert_one_line_error(cp, "--api-key would put the secret on the command line",
                          "--api-key-file")
    assert cp.returncode == 2 and "sk-do-not-print" not in cp.stderr + cp.stdout
    # an abbreviation argparse cannot resolve is quoted back: its value is not
    cp = in_process(capsys, *command, "--api=sk-do-not-print")
    assert cp.returncode == 2 and "sk-do-not-print" not in cp.stderr + cp.stdout


@pytest.mark.parametrize("argv,needles", [
    (["--stop", "x"], ["--stop works with --endpoint only"]),
    (["--timeout", "5", "--tls"], ["--timeout, --tls work with --endpoint only"]),
    (["--tls-server-name", "a"], ["--tls-server-name works with --endpoint only"]),
])
def test_gateway_flags_are_refused_in_process(argv, needles, capsys):
    """The flags a gateway applies are refused in process, not dropped (a --stop that
    never stopped the text), before any model loads."""
    cp = in_process(capsys, "generate", "--model", "no-such-model", "--prompt", "hi", *argv)
    assert_one_line_error(cp, *needles)


def test_endpoint_failures_exit_by_whose_fault(capsys):
    """A malformed --endpoint is a usage error (2); a gateway that does not answer is a
    runtime failure (1), worth a retry."""
    cp = in_process(capsys, "generate", "--prompt", "hi", "--endpoint", "notaport")
    assert_one_line_error(cp, "--endpoint", "not HOST:PORT")
    assert cp.returncode == 2
    cp = in_process(capsys, "generate", "--prompt", "hi", "--endpoint", "127.0.0.1:1")
    assert_one_line_error(cp, "unavailable", "is the gateway up")
    assert cp.returncode == 1


def test_conflicting_execution_flags_are_refused(capsys):
    cp = in_process(capsys, "serve", "m", "--compile", "--enforce-eager")
    assert_one_line_error(cp, "--enforce-eager", "not allowed with argument --compile")


def test_an_unwritable_out_is_refused_before_any_work(tmp_path, capsys):
    """--out that is a file (for a folder), a folder (for a file) or lies under a file is
    a usage error at once, not a traceback after the benchmark ran; a missing folder is
    made."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv, needle in [(["bench", "--out", str(blocker)], "is a file, not a folder"),
                         (["project", "--out", str(blocker / "x")], "is a file, not a folder"),
                         (["bench-serve", "--out", str(tmp_path)], "is a folder"),
                         (["bench-serve", "--out", str(blocker / "r.json")], "not a folder")]:
        cp = in_process(capsys, *argv)
        assert_one_line_error(cp, "--out", needle)
        assert cp.returncode == 2
    # checked, not made: a command line refused later (or --help) leaves nothing behind
    cp = in_process(capsys, "bench", "--out", str(tmp_path / "new" / "x"), "--no-such-flag")
    assert cp.returncode == 2 and not (tmp_path / "new").exists()
    cp = in_process(capsys, "bench-serve", "--out", "~no-such-user-zz/r.json")
    assert_one_line_error(cp, "--out", "no such user's home")
