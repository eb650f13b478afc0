"""``PipelineConfig``: the one message that tells every process of a pipeline what it is.

Everything the stages, the draft service and the gateway of one pipeline must agree
on (model, dtype, execution mode, quantization, transport, layout, tree width, limits)
is built once, from a manifest and its plan (:func:`orchestrator.deploy.commands.config_of`)
or from a hand-started process's flags (:mod:`orchestrator.cli.pipeline_config`), and
reaches each process as this one frozen, strictly validated object (``--config FILE``:
a file next to the local run state, a ConfigMap key in a pod).  Per-process things (its name,
addresses, device, layer range) stay flags.

It lives in protocol/ so that the device processes read it without the control plane.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.config.limits import DEFAULT_PREFILL_CHUNK_ROWS, MAX_CONCURRENCY
from protocol.config.recovery import parse_recovery
from protocol.errors import TreepipeError
from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE

MAX_COUNT = 2**31 - 1  # every count and size, as the manifest's and the flags' bounds
Dtype = Literal["float32", "float64", "bfloat16", "float16"]  # loading.DTYPES (a test checks)
Execution = Literal["auto", "eager", "tuned", "compiled"]  # execution_modes.EXECUTION_MODES
Quantize = Literal["none", "int8"]  # execution_modes.QUANTIZE_MODES
Transport = Literal["zmq", "grpc"]  # protocol.links.keys.TRANSPORTS


# what to do about a bad --config FILE, the end of each of its one-line errors
FIX = ("pass the pipeline config that treepipe up or treepipe render wrote, or the "
       "pipeline's flags (--pipeline, --model, ...) instead of --config")


class ConfigFileError(TreepipeError):
    """A pipeline config file that cannot be used; one line naming the file and the fix."""


class _Frozen(BaseModel):
    """Immutable, strict (no "3" for 3, no true for 1), unknown fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def runtime_recovery(v: str) -> str:
    """A ``recovery`` setting a pipeline's processes can run; ValueError naming the fix."""
    if parse_recovery(v).draft_only:  # parse_recovery's ValueError names a bad spelling
        raise ValueError(f"{v}: +draft runs in process only (treepipe generate and bench): "
                         "the exit stage does not hold the draft's proposals; drop +draft, "
                         "or use +vocab=FILE:N for a cheap exit")
    return v


class DraftConfig(_Frozen):
    """The token source that owns the tree, and the tree's shape."""

    source: str = Field(default="ngram", min_length=1, max_length=4096, pattern=r"^\S+$")
    model: str = Field(default="layers:4", min_length=1, max_length=4096)  # of hybrid
    width: int = Field(default=16, ge=1, le=MAX_COUNT)  # the cap when adaptive
    topk: int = Field(default=8, ge=1, le=MAX_COUNT)
    adaptive: bool = False
    # protocol.config.recovery; with an early exit's vocabulary file or adapter path
    recovery: str = Field(default="none", max_length=4096)

    @field_validator("recovery")
    @classmethod
    def _recovery(cls, v: str) -> str:
        return runtime_recovery(v)


class LimitsConfig(_Frozen):
    """What the gateway admits and the stages' KV pools hold."""

    # the stages' pool in rows (None: it grows with the requests, no admission budget)
    kv_tokens: int | None = Field(default=None, ge=DEFAULT_BLOCK_SIZE, le=MAX_COUNT)
    concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY)
    prefill_chunk: int = Field(default=DEFAULT_PREFILL_CHUNK_ROWS, ge=1, le=MAX_COUNT)
    max_new_tokens: int = Field(default=1024, ge=1, le=MAX_COUNT)
    context_length: int | None = Field(default=None, ge=1, le=MAX_COUNT)  # None: the model's


class PipelineConfig(_Frozen):
    """One pipeline's shared settings; the defaults are the hand-started flags' defaults."""

    version: Literal[1] = 1  # a later format is refused by name, not misread
    pipeline: str = Field(min_length=1, max_length=253)  # the Redis key namespace
    model: str = Field(default="smollm2-135m", min_length=1, max_length=4096)
    dtype: Dtype = "float32"
    execution: Execution = "auto"
    quantize: Quantize = "none"  # the stages' weights (stages.model.quantization)
    transport: Transport = "zmq"
    # the layout id (--plan): workers of a new one take the pipeline over
    plan: str = Field(default="", max_length=64)
    stages: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    # every stage's [start, end) layers; None for processes started by hand, which know
    # only their own range
    layers: tuple[tuple[int, int], ...] | None = None
    draft: DraftConfig = Field(default_factory=DraftConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @model_validator(mode="after")
    def _consistent(self) -> PipelineConfig:
        if bool(self.plan) != bool(self.stages):
            raise ValueError("plan and stages: give both (a planned pipeline) or neither")
        if self.layers is not None:
            if len(self.layers) != self.stages:
                raise ValueError(f"layers: lists {len(self.layers)} ranges for "
                                 f"{self.stages} stages")
            end = 0
            for i, (a, b) in enumerate(self.layers):
                if a != end or not a < b <= MAX_COUNT:
                    raise ValueError(f"layers[{i}]: [{a}, {b}) does not continue the "
                                     f"ranges before it at layer {end}")
                end = b
        if self.stages is not None:  # an exit stage that saves no step: named fix
            parse_recovery(self.draft.recovery).check_stages(self.stages)
        return self

    @property
    def tree_width(self) -> int:
        """Nodes per level the draft sends at most: its width (the cap when adaptive),
        one for a pipeline without speculation."""
        return 1 if self.draft.source == "none" else self.draft.width

    def to_json(self) -> str:
        """The message as written to a file or a ConfigMap."""
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes, origin: str) -> PipelineConfig:
        """Parse and validate ``text``; a :class:`ConfigFileError` naming ``origin``."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            raise ConfigFileError(f"{origin}: {where}: {msg}; {FIX}") from None


def load_pipeline_config(path: str | Path) -> PipelineConfig:
    """Read and validate the pipeline config file ``path`` (one-line ConfigFileError)."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"cannot read --config {p}: {e.strerror or e}; {FIX}") from None
    return PipelineConfig.from_json(text, f"--config {p}")
