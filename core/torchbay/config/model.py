"""The one configuration tree: the core sections, :class:`Section` (what a plugin's section subclasses), and
:class:`ResolvedConfig` (a validated tree and where each value came from). How a tree is resolved from its
sources is :mod:`torchbay.registry.resolve`.

Sources, lowest first: defaults < config file (YAML) < ``TORCHBAY_*`` environment <
command-line flags < ``Accelerator(...)`` arguments. Every section forbids unknown keys;
a misspelt or renamed key is an error with a suggestion. Plugins add sections through the
``torchbay_config_sections`` hook. Workers receive the resolved tree as one JSON value in
``TORCHBAY_RESOLVED_CONFIG``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Mapping, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import core_schema

from torchbay.config.files import CONFIG_FILE_ENV

RESOLVED_ENV = "TORCHBAY_RESOLVED_CONFIG"


#: TORCHBAY_* variables that control torchbay itself rather than set config values
CONTROL_ENV = {RESOLVED_ENV, CONFIG_FILE_ENV, "TORCHBAY_PLUGINS", "TORCHBAY_DISABLE_PLUGIN_AUTOLOAD",
               "TORCHBAY_BLOCK_PLUGINS", "TORCHBAY_LOG_LEVEL", "TORCHBAY_TEST_MARKER", "TORCHBAY_RUN_DIR",
               "TORCHBAY_LAUNCHER_PID", "TORCHBAY_AS_ACCELERATE"}


#: keys people carry over from other tools or older layouts: where they live now
RENAMED_KEYS = {
    "distributed_type": "strategy",
    "num_processes": "launch.num_processes",
    "num_machines": "launch.num_machines",
    "machine_rank": "launch.machine_rank",
    "main_process_ip": "launch.main_process_ip",
    "main_process_port": "launch.main_process_port",
    "split_batches": "dataloader.split_batches",
    "dispatch_batches": "dataloader.dispatch_batches",
    "even_batches": "dataloader.even_batches",
    "use_seedable_sampler": "dataloader.use_seedable_sampler",
    "project_dir": "project.project_dir",
    "total_limit": "project.total_limit",
    "required_plugins": "plugins.required",
    "gradient_accumulation": "gradient_accumulation_steps",
    "fp8_backend": "fp8.backend",
    "use_cpu": "device (set device: cpu)",
    "log_with": "tracking.log_with",
}


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on set."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, defer_build=True)


class BuiltOnUse:
    """The validation of a section field, in the tree's own validator: a section given as a mapping is validated
    by its model, whose validator is built then (the first time); one given as an instance is taken as it is.

    A validator that held every section's own would build all of them (about 1.5 ms each) in every run, for the
    20-odd sections of the installed plugins, though a run gives input to few. Errors keep their place
    (``mysection.key``), unknown keys are still refused, and dumps and the JSON schema are the section's own.
    """

    def __get_pydantic_core_schema__(self, model: type[BaseModel], handler) -> core_schema.CoreSchema:
        def validate(value: Any) -> BaseModel:
            return value if isinstance(value, model) else model.model_validate(value)

        def dump(value: BaseModel, info) -> Any:
            return value.model_dump(mode=info.mode, by_alias=info.by_alias)

        def json_schema(_schema, json_handler) -> dict:
            model.model_rebuild()  # the schema only: `torchbay config schema`
            return json_handler(model.__pydantic_core_schema__)

        return core_schema.no_info_plain_validator_function(
            validate, serialization=core_schema.plain_serializer_function_ser_schema(dump, info_arg=True),
            metadata={"pydantic_js_functions": [json_schema]})


SectionModel = TypeVar("SectionModel", bound=BaseModel)
#: the annotation of a section field of the tree: ``LazySection[MySection]``
LazySection = Annotated[SectionModel, BuiltOnUse()]


def section_field(model: type[BaseModel]) -> Any:
    """The field of a section: its default is the model's defaults, without building its validator (a model with
    a model validator of its own is built and validated, so that the validator runs on its defaults too)."""
    defaults = model if model.__pydantic_decorators__.model_validators else model.model_construct
    return Field(default_factory=defaults)


class DataLoaderSection(Section):
    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = Field(False, description="iterating after load_state goes on from the saved "
                                                             "position (else use skip_first_batches)")


class ProjectSection(Section):
    project_dir: str = "."
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = Field(None, ge=1)
    iteration: int = Field(0, ge=0)


class CheckpointSection(Section):
    io: str = Field("safetensors", description="checkpoint io plugin that writes model weights")
    max_shard_size: str = Field("5GB", pattern=r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
    verify: bool = Field(True, description="check every file's size and checksum against the manifest before "
                                            "loading (turn off only for very large checkpoints on trusted storage)")
    allow_unsafe_pickle: bool = Field(False, description="load pickled Python objects from checkpoints: this RUNS "
                                                         "CODE from the files; only for checkpoints you wrote yourself")
    async_save: bool = Field(False, description="automatic checkpoints (save_state() with project."
                                                "automatic_checkpoint_naming) are written in the background, as "
                                                "save_state(blocking=False): the state is copied in the call")
    async_writer_nice: int = Field(10, ge=0, le=19, description="how much lower the CPU priority of the writer of "
                                                               "save_state(blocking=False) is than the training "
                                                               "loop's (a nice increment, Linux): on busy cores the "
                                                               "loop goes first; 0: the same priority")


class LaunchSection(Section):
    num_processes: Optional[int] = Field(None, ge=1, description="total processes across all machines")
    nproc_per_node: Optional[int] = Field(None, ge=1, description="processes on each machine")
    num_machines: int = Field(1, ge=1)
    machine_rank: int = Field(0, ge=0)
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = Field(None, ge=1, le=65535)
    rdzv_backend: str = "static"
    rdzv_endpoint: Optional[str] = None
    rdzv_id: str = Field("none", description="rendezvous job id, the same on every machine of a job")
    max_restarts: int = Field(0, ge=0)
    monitor_interval: float = Field(0.1, gt=0)
    cpu_threads_per_process: Optional[int] = Field(None, ge=1, description="OMP_NUM_THREADS of every worker "
                                                   "(default: the cores shared out on the cpu device, else 1)")
    tee: Optional[str] = Field(None, description="torchrun --tee: also write each worker's output (0..3) to log_dir")
    log_dir: Optional[str] = Field(None, description="torchrun --log-dir: where worker logs go")
    rdzv_conf: Optional[str] = Field(None, description="torchrun --rdzv-conf: extra rendezvous settings (k1=v1,k2=v2)")
    as_accelerate: bool = Field(False, description="the workers answer `import accelerate` with torchbay, for "
                                                   "transformers/peft/trl/diffusers (TORCHBAY_AS_ACCELERATE=1 in "
                                                   "their environment)")


class PluginsSection(Section):
    required: list[str] = Field(default_factory=list, description="fail unless these plugins are loaded")


class TrackingSection(Section):
    log_with: list[str] = Field(default_factory=list,
                                description="experiment trackers to log to, by name (jsonl is built in; 'all': every "
                                            "installed tracker); several: repeat the flag or separate with commas")
    logging_dir: Optional[str] = Field(None, description="directory under which every tracker writes (each in "
                                                         "<logging_dir>/<tracker>); default: project.logging_dir, "
                                                         "else <project.project_dir>/logs")

    @field_validator("log_with", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """``"a,b"`` or ``["a", "b,c"]`` -> ``["a", "b", "c"]``; ``None`` -> ``[]``."""
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            out = []
            for item in value:
                if not isinstance(item, str):
                    return value  # the model reports the wrong type
                out += [part.strip() for part in str.__str__(item).split(",") if part.strip()]
            for name in out:
                if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                    raise ValueError(f"{name!r} is not a tracker name (lower-case letters, digits and _, e.g. "
                                     f"jsonl; 'all' for every installed tracker)")
            return out
        return value


class CompileSection(Section):
    """``torch.compile`` of the prepared models (torchbay.compile.compiler; docs/configuration.md)."""

    enabled: Union[bool, Literal["auto"]] = Field(
        "auto", description="compile prepared models: true, false, or auto (only where the precision needs it to "
                            "be fast, as an FP8 engine may)")
    backend: str = Field("inductor", description="torch.compile backend (inductor, aot_eager, eager, cudagraphs...)")
    mode: Optional[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = None
    fullgraph: bool = Field(False, description="fail on a graph break instead of running that part eagerly")
    dynamic: Optional[bool] = Field(None, description="dynamic shapes: true, false, or null (torch decides)")
    regional: bool = Field(False, description="compile each repeated block (a ModuleList of one class) instead of "
                                              "the whole model: a faster cold start")
    options: dict[str, Any] = Field(default_factory=dict, description="backend options (torch.compile options=)")


class TelemetrySection(Section):
    """What training does, logged every N optimizer steps (torchbay.telemetry; docs/telemetry.md)."""

    enabled: bool = Field(False, description="log throughput, TFLOP/s, MFU, step and data-wait time and memory per "
                                             "rank through the trackers (off: nothing is measured)")
    every_n_steps: int = Field(10, ge=1, description="optimizer steps per telemetry record")
    count_flops: bool = Field(True, description="count the first step's FLOPs with torch's FlopCounterMode")
    flops_per_step: Optional[float] = Field(None, gt=0, description="model FLOPs of one optimizer step on one "
                                                                    "process, when you know them (no counting)")
    peak_tflops: Optional[float] = Field(None, gt=0, description="the device's peak TFLOP/s for MFU, overriding "
                                                                 "the device plugin's published figure")
    memory_snapshot: bool = Field(False, description="record the device allocator's history and write its "
                                                     "snapshot after the first step and on out-of-memory, for torch's "
                                                     "viewer (where the device plugin can write one)")
    memory_snapshot_entries: int = Field(100000, ge=1, description="allocator events the snapshot keeps")


class CoreConfig(Section):
    """The core's part of the tree; plugin sections are added by :func:`config_model`."""

    device: str = Field("auto", description="a registered device name, or auto")
    visible_devices: Optional[str] = Field(None, pattern=r"^[\w.-]+(,[\w.-]+)*$",
                                           description="device ids the workers of torchbay launch see (the device's "
                                                       "visible-devices variable), comma-separated; unset: inherit")
    strategy: str = Field("auto", description="a registered strategy name, or auto (ddp with >1 process; the strategy "
                                                  "that builds them when parallelism asks for dimensions ddp does not)")
    mixed_precision: str = Field("no", pattern=r"^[a-z][a-z0-9_]*$",
                                 description="no, fp16, bf16, or a mode an installed plugin registers")
    gradient_accumulation_steps: int = Field(1, ge=1)
    seed: Optional[int] = None
    step_scheduler_with_optimizer: bool = True
    device_placement: bool = True
    process_group_backend: Optional[str] = None
    process_group_timeout_s: Optional[float] = Field(
        600.0, gt=0, description="seconds a collective waits for every rank before it fails (and torchbay launch "
                                 "reports where each rank was); null: torch's own default (30 min)")
    dataloader: LazySection[DataLoaderSection] = section_field(DataLoaderSection)
    project: LazySection[ProjectSection] = section_field(ProjectSection)
    checkpoint: LazySection[CheckpointSection] = section_field(CheckpointSection)
    launch: LazySection[LaunchSection] = section_field(LaunchSection)
    plugins: LazySection[PluginsSection] = section_field(PluginsSection)
    tracking: LazySection[TrackingSection] = section_field(TrackingSection)
    compile: LazySection[CompileSection] = section_field(CompileSection)
    telemetry: LazySection[TelemetrySection] = section_field(TelemetrySection)


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """``TORCHBAY_MIXED_PRECISION=bf16`` -> ``{"mixed_precision": "bf16"}``; ``__`` nests."""
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("TORCHBAY_") or name in CONTROL_ENV:
            continue
        import yaml  # here: a run without TORCHBAY_ settings imports no YAML (config/files.py says why)

        path = name[len("TORCHBAY_"):].lower().split("__")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        set_path(out, path, value)
    return out


def set_path(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[path[-1]] = value


def dotted_to_tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        set_path(tree, key.split("."), value)
    return tree


def merge(base: dict, layer: Mapping, source: str, sources: dict[str, str], prefix: str = "") -> dict:
    """Deep-merge ``layer`` into ``base`` (in place), recording ``source`` per leaf."""
    for key, value in layer.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and value:
            merge(base[key], value, source, sources, dotted + ".")
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
            for existing in [k for k in sources if k.startswith(dotted + ".")]:
                del sources[existing]
            _record_leaves(value, dotted, source, sources)
    return base


def _record_leaves(value: Any, dotted: str, source: str, sources: dict[str, str]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _record_leaves(v, f"{dotted}.{k}", source, sources)
    else:
        sources[dotted] = source


class ResolvedConfig:
    """A validated config tree and, for every value, the source that set it."""

    def __init__(self, config: CoreConfig, sources: dict[str, str]):
        self.config = config
        self.sources = sources

    def source_of(self, dotted: str) -> str:
        while dotted:
            if dotted in self.sources:
                return self.sources[dotted]
            dotted = dotted.rpartition(".")[0]
        return "default"

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}

        def walk(node: Any, prefix: str) -> None:
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    walk(v, f"{prefix}.{k}" if prefix else k)
            else:
                out[prefix] = node

        walk(self.config.model_dump(mode="json"), "")
        return out

    def to_json(self) -> str:
        return json.dumps({"config": self.config.model_dump(mode="json"), "sources": self.sources})
