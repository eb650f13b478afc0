"""A pipeline process's :class:`PipelineConfig`: its ``--config`` file, or its flags.

``treepipe up`` and the Kubernetes render pass every stage, the draft and the gateway
``--config FILE`` (orchestrator/deploy/commands.py); a process started by hand gives the
same settings as flags (``--pipeline --model --dtype --width ...``), which become the
same validated object here.  Either way the process then reads its settings from that
object alone: one path, flags -> PipelineConfig -> the process.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from orchestrator.cli.flags import shown
from protocol.config.pipeline import PipelineConfig, load_pipeline_config
from protocol.errors import TreepipeError

# flag dest -> where the config holds it; a process parses the subset it has flags for
FIELDS: dict[str, tuple[str, ...]] = {
    "pipeline": ("pipeline",), "model": ("model",), "dtype": ("dtype",),
    "execution": ("execution",), "quantize": ("quantize",), "transport": ("transport",),
    "plan": ("plan",),
    "stages": ("stages",), "source": ("draft", "source"), "draft_model": ("draft", "model"),
    "width": ("draft", "width"), "topk": ("draft", "topk"),
    "adaptive": ("draft", "adaptive"), "recovery": ("draft", "recovery"),
    "kv_tokens": ("limits", "kv_tokens"),
    "concurrency": ("limits", "concurrency"), "prefill_chunk": ("limits", "prefill_chunk"),
    "max_new_tokens": ("limits", "max_new_tokens"),
    "context_length": ("limits", "context_length"),
    # the gateway's name for the draft's level width (its cap when adaptive)
    "draft_width": ("draft", "width"),
}


_DEFAULTS = PipelineConfig(pipeline="-")  # every other field at its default


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _text(v: Any) -> str:
    """A flag's value for a one-line error: a string quoted and cut short, a number bare."""
    return shown(v) if isinstance(v, str) else str(v)


def _given(a: argparse.Namespace) -> dict[str, Any]:
    """The pipeline flags this command line sets (their defaults are None: unset)."""
    return {d: getattr(a, d) for d in FIELDS if getattr(a, d, None) is not None}


def _value(cfg: PipelineConfig, dest: str) -> Any:
    if dest == "draft_width":  # what the gateway prices: 1 without speculation
        return cfg.tree_width
    obj: Any = cfg
    for part in FIELDS[dest]:
        obj = getattr(obj, part)
    return obj


def default_of(dest: str) -> str:
    """The config's default of a pipeline flag, as the flag's help names it (the flags
    themselves default to None: unset)."""
    return str(_value(_DEFAULTS, dest))


def config_from_flags(a: argparse.Namespace) -> PipelineConfig:
    """The config a hand-started process's flags describe (unset ones: the defaults)."""
    data: dict[str, Any] = {}
    for dest, v in _given(a).items():
        *outer, last = FIELDS[dest]
        inner = data
        for part in outer:
            inner = inner.setdefault(part, {})
        inner[last] = v
    if "pipeline" not in data:
        raise TreepipeError("pass --pipeline NAME (the pipeline's Redis key namespace), or "
                            "--config FILE with the pipeline's settings")
    if bool(data.get("plan")) != bool(data.get("stages")):
        raise TreepipeError("pass --plan and --stages together (or neither, when something "
                            "else registers the participants)")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        flag = next((_flag(d) for d, path in FIELDS.items() if path == loc), None)
        msg = err["msg"].removeprefix("Value error, ")
        if flag is None:  # a rule over several fields
            raise TreepipeError(f"the pipeline's flags: {msg}") from None
        raise TreepipeError(f"{flag} {_text(err['input'])}: {msg}") from None


def resolve_pipeline(a: argparse.Namespace) -> PipelineConfig:
    """The process's config (``--config FILE``, else its flags), validated once.

    Every pipeline field of ``a`` is then set from it, so the process reads its settings
    from that one object whichever way they came.  A pipeline flag given beside
    ``--config`` must agree with the file: one line naming both otherwise.
    """
    cfg = getattr(a, "pipeline_config", None)
    if cfg is not None:  # resolved already (the checks run before the command)
        return cfg
    if a.config:
        cfg = load_pipeline_config(a.config)
        for dest, v in _given(a).items():
            if v != _value(cfg, dest):
                raise TreepipeError(f"{_flag(dest)} {_text(v)} disagrees with --config "
                                    f"{a.config} ({_text(_value(cfg, dest))}); drop "
                                    f"{_flag(dest)}, or fix the file")
    else:
        cfg = config_from_flags(a)
    for dest in FIELDS:
        if hasattr(a, dest):
            setattr(a, dest, _value(cfg, dest))
    a.pipeline_config = cfg
    return cfg
