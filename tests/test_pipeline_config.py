"""One ``PipelineConfig`` per pipeline: built once, sent to every process as one message.

The launcher's and the render's command lines name it (``--config``), the processes
validate it before anything loads, hand-started processes build the same object from
their flags, and ``scale.json`` carries the typed manifest.  No model loads here: the
checks run on parsed command lines (tests/test_worker_commands.py parses every example).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import get_args

import pydantic
import pytest
import yaml

from orchestrator.cli.main import build_parser, main
from orchestrator.cli.pipeline_config import resolve_pipeline
from orchestrator.deploy.commands import config_of
from orchestrator.deploy.launcher import (
    SCALE_FILE,
    TREEPIPE,
    ScaleRequest,
    Supervisor,
    take_scale_request,
)
from orchestrator.deploy.manifest import with_stage_count
from orchestrator.deploy.planner import load_planned, plan_manifest
from orchestrator.deploy.render import CONFIG_FILE, CONFIG_KEY, CONFIG_PATH, render
from orchestrator.models.loading import DTYPES
from protocol.config.pipeline import (
    Dtype,
    Execution,
    PipelineConfig,
    Quantize,
    Transport,
    load_pipeline_config,
)
from protocol.links.keys import TRANSPORTS
from stages.model.execution_modes import EXECUTION_MODES, QUANTIZE_MODES

LOCAL = Path(__file__).resolve().parent.parent / "manifests" / "examples" / "local.yaml"
REDIS = "redis://127.0.0.1:9/0"
# per-process flags of a hand-started stage (no pipeline settings among them)
STAGE = ["stage", "--name", "stage0", "--redis", REDIS, "--layers", "0:2", "--listen",
         "127.0.0.1:0", "--insecure-links"]


@pytest.fixture(scope="module")
def planned():  # noqa: ANN201 - a Planned
    return load_planned(LOCAL)


def test_the_config_round_trips_and_is_frozen_and_strict(planned) -> None:  # noqa: ANN001
    m, p = planned
    cfg = config_of(m, p)
    assert cfg.pipeline == m.metadata.name and cfg.plan == p.layout_id
    assert cfg.layers == tuple(tuple(s.layers) for s in p.stages)
    assert cfg.limits.kv_tokens == p.kv_tokens and cfg.draft.width == m.spec.draft.width
    assert PipelineConfig.from_json(cfg.to_json(), "x") == cfg
    with pytest.raises(pydantic.ValidationError):
        cfg.draft.width = 3  # type: ignore[misc]  # one message, never edited on the way
    data = json.loads(cfg.to_json())
    data["draft"]["width"] = "16"  # strict: a string is no number
    with pytest.raises(Exception, match=r"x: draft.width: .*; pass the pipeline config"):
        PipelineConfig.from_json(json.dumps(data), "x")


def test_the_configs_choices_are_the_runtimes() -> None:
    # protocol/ cannot import the loader or the transports' registry: the lists must agree
    assert set(get_args(Dtype)) == set(DTYPES)
    assert set(get_args(Execution)) == set(EXECUTION_MODES)
    assert set(get_args(Quantize)) == set(QUANTIZE_MODES)
    assert set(get_args(Transport)) == set(TRANSPORTS)


@pytest.mark.parametrize("text, needle", [
    (None, "cannot read --config"),
    ("{", "Invalid JSON"),
    ('{"version": 2, "pipeline": "p"}', "version"),
    ('{"pipeline": "p", "width": 4}', "width: Extra inputs"),
    ('{"pipeline": "p", "limits": {"concurrency": 65}}', "limits.concurrency"),
    ('{"pipeline": "p", "quantize": "int4"}', "quantize: Input should be 'none' or 'int8'"),
    ('{"pipeline": "p", "plan": "ab", "stages": 2, "layers": [[0, 2], [3, 4]]}',
     "layers[1]"),
    # mismatched with this process: its name, its layer range
    ('{"pipeline": "other"}', "--pipeline 'p' disagrees with --config"),
    ('{"pipeline": "p", "plan": "ab", "stages": 2, "layers": [[0, 3], [3, 4]]}',
     "--layers 0:2 of stage0 disagrees with --config"),
])
def test_a_bad_or_mismatched_config_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None,
        needle: str) -> None:
    f = tmp_path / "config.json"
    if text is not None:
        f.write_text(text)
    extra = ["--pipeline", "p"] if "other" in (text or "") else []
    rc = main([*STAGE, "--config", str(f), *extra])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(f) in lines[0] and needle in lines[0], lines[0]


def test_flags_and_a_config_file_give_the_process_one_config(tmp_path: Path) -> None:
    """A hand-started draft's old flags and the launcher's --config reach the same object,
    and the same fields of the parsed command line."""
    flags = ["draft", "serve", "--name", "draft", "--redis", REDIS, "--next", "127.0.0.1:1",
             "--insecure-links"]
    by_hand = build_parser().parse_args([*flags, "--pipeline", "p", "--dtype", "float64",
                                         "--quantize", "int8", "--width", "4", "--topk", "2",
                                         "--adaptive", "--plan", "ab", "--stages", "2",
                                         "--kv-tokens", "64"])
    cfg = resolve_pipeline(by_hand)
    assert cfg == PipelineConfig(pipeline="p", dtype="float64", quantize="int8", plan="ab",
                                 stages=2, draft={"width": 4, "topk": 2, "adaptive": True},
                                 limits={"kv_tokens": 64})
    f = tmp_path / "c.json"
    f.write_text(cfg.to_json())
    from_file = build_parser().parse_args([*flags, "--config", str(f)])
    assert resolve_pipeline(from_file) == cfg
    keys = ("pipeline", "model", "dtype", "execution", "quantize", "transport", "plan",
            "stages",
            "source", "draft_model", "width", "topk", "adaptive", "kv_tokens")
    assert {k: getattr(from_file, k) for k in keys} == {k: getattr(by_hand, k) for k in keys}
    # defaults: what the flags defaulted to before the config existed
    bare = resolve_pipeline(build_parser().parse_args([*flags, "--pipeline", "p"]))
    assert (bare.model, bare.dtype, bare.transport, bare.draft.width, bare.draft.topk) == (
        "smollm2-135m", "float32", "zmq", 16, 8)
    # a flag beside --config that agrees is fine; one that differs is refused
    assert resolve_pipeline(build_parser().parse_args(
        [*flags, "--config", str(f), "--width", "4"])) == cfg
    with pytest.raises(Exception, match=r"--width 8 disagrees with --config .*c.json \(4\)"):
        resolve_pipeline(build_parser().parse_args([*flags, "--config", str(f),
                                                    "--width", "8"]))


def test_the_gateway_reads_its_limits_from_the_config(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli.gateway_commands import check_gateway_args

    cfg = PipelineConfig(pipeline="p", draft={"source": "none", "width": 8},
                         limits={"concurrency": 3, "kv_tokens": 128, "max_new_tokens": 9})
    f = tmp_path / "c.json"
    f.write_text(cfg.to_json())
    ns = build_parser().parse_args(["gateway", "--redis", REDIS, "--config", str(f)])
    check_gateway_args(ns)
    assert (ns.pipeline, ns.concurrency, ns.kv_tokens, ns.max_new_tokens, ns.draft_width) == (
        "p", 3, 128, 9, 1)  # no speculation: one node a level
    assert main(["gateway", "--redis", REDIS]) == 2  # no --pipeline and no --config
    assert "pass --pipeline NAME" in capsys.readouterr().err


def test_the_launcher_and_the_render_pass_the_one_config(planned, tmp_path: Path) -> None:  # noqa: ANN001
    m, p = planned
    argv = Supervisor(m, p, tmp_path, LOCAL).commands(REDIS, 50151)
    cfg = config_of(m, p)
    for name, cmd in argv.items():
        args = cmd[len(TREEPIPE):]
        path = args[args.index("--config") + 1]
        assert Path(path).parent == tmp_path, name  # beside the run state
        assert load_pipeline_config(path) == cfg
        # the pipeline's settings travel in the file alone
        assert not {"--pipeline", "--model", "--dtype", "--width", "--kv-tokens",
                    "--concurrency"} & set(args), (name, args)
    objs = render(m, the_plan=p)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert PipelineConfig.from_json(cm["data"][CONFIG_KEY], "cm") == cfg
    for o in objs:
        tmpl = o.get("spec", {}).get("template")
        if not tmpl or tmpl["spec"]["containers"][0]["name"] == "redis":
            continue
        c = tmpl["spec"]["containers"][0]
        assert c["args"][c["args"].index("--config") + 1] == CONFIG_FILE
        mount = next(v for v in c["volumeMounts"] if v["mountPath"] == CONFIG_PATH)
        vol = next(v for v in tmpl["spec"]["volumes"] if v["name"] == mount["name"])
        assert vol["configMap"]["name"] == cm["metadata"]["name"] and mount["readOnly"]


def test_scale_json_carries_the_typed_manifest(planned, tmp_path: Path,  # noqa: ANN001
                                               caplog: pytest.LogCaptureFixture) -> None:
    m, _ = planned
    want = plan_manifest(with_stage_count(m.to_yaml_dict(), 2))
    req = ScaleRequest(manifest=want.manifest, layout_id=want.plan.layout_id)
    (tmp_path / SCALE_FILE).write_text(req.to_json())
    got = take_scale_request(tmp_path)
    assert got is not None and got.plan.layout_id == want.plan.layout_id
    assert len(got.plan.stages) == 2 and got.manifest == want.manifest
    # planned as another layout than `treepipe scale` computed: dropped, not run
    (tmp_path / SCALE_FILE).write_text(req.model_copy(update={"layout_id": "0" * 12}).to_json())
    with caplog.at_level(logging.ERROR, logger="treepipe.launcher"):
        assert take_scale_request(tmp_path) is None
    assert "not a re-plan request" in caplog.text
    # the old raw-dict form is no longer taken
    (tmp_path / SCALE_FILE).write_text(json.dumps({"manifest": yaml.safe_load(
        LOCAL.read_text())}))
    assert take_scale_request(tmp_path) is None
