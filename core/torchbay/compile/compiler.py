"""``torch.compile`` as a config-selected step of ``prepare`` (the ``compile`` section).

:class:`ModelCompiler` runs last in ``prepare``, after the precision converted the model (FP8
Linears), the strategy wrapped or sharded it (DDP, or a sharding strategy per block) and the forward got its
autocast. It compiles the modules the strategy names (:meth:`Strategy.compile_targets`) *in
place*: each keeps its class, parameter names and ``state_dict`` keys, the prepared object is the
one the strategy returned, and ``unwrap_model`` returns the user's module. ``compile.enabled:
auto`` compiles only a model whose precision says it needs compiling to be fast
(:meth:`Precision.compile_reason`).

Also here: Accelerate's names for the same thing (``TorchDynamoPlugin``, ``DynamoBackend``,
``compile_regions``, ``has_compiled_regions``) and what ``Accelerator(dynamo_backend=...,
dynamo_plugin=...)`` means as config.
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from torchbay.config.flags import str_to_bool
from torchbay.errors import ConfigError

log = logging.getLogger("torchbay")

#: torch.compile's own backend when compile.backend is left as is
DEFAULT_BACKEND = "inductor"


# --- which modules to compile ---------------------------------------------------------------


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """A ``ModuleList`` of two or more children of one class (the layers of a transformer)."""
    return (isinstance(module, torch.nn.ModuleList) and len(module) > 1
            and len({type(child) for child in module}) == 1)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the outermost repeated-block lists of ``model``, in module order."""
    blocks: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        if is_repeated_blocks(module):
            blocks.extend(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return blocks


def is_compiled(module: torch.nn.Module) -> bool:
    """Compiled by ``torch.compile`` (an ``OptimizedModule``), by ``Module.compile`` or in place here."""
    return (getattr(module, "_compiled_call_impl", None) is not None
            or hasattr(getattr(module.__dict__.get("forward"), "__func__", None), "_torchdynamo_orig_callable")
            or (hasattr(torch, "_dynamo") and isinstance(module, torch._dynamo.eval_frame.OptimizedModule)))


def compile_in_place(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Compile the forward of ``module`` in place, so that the module keeps its identity.

    Only the forward is compiled: the module's hooks still run eagerly around it (a strategy's
    own, such as a pre-hook that counts steps, would otherwise be traced and recompile the
    graph at every step). The compiled frame is torchbay's, which dynamo traces, inlining the
    forward: ``Module.compile`` alone leaves a module whose forward is torch's own (``nn.Sequential``)
    uncompiled, dynamo skipping frames of torch.nn.
    """
    module._torchbay_uncompiled_forward = module.forward
    module.forward = bind_forward(module, torch.compile(_call_uncompiled_forward, **compile_kwargs),
                                  like=module._torchbay_uncompiled_forward)
    return module


def bind_forward(module: torch.nn.Module, function: Any, like: Any) -> types.MethodType:
    """``function(module, *args, **kwargs)`` as ``module``'s forward, showing ``like``'s signature.

    Bound as a method, so that a deep copy of the module (an EMA, a teacher) runs its own forward,
    not the original's; with the signature of the forward it replaces, because libraries read it
    (transformers' Trainer keeps the batch columns the forward names).
    """
    try:
        signature = inspect.signature(like)
        first = inspect.Parameter("_torchbay_module", inspect.Parameter.POSITIONAL_ONLY)
        function.__signature__ = signature.replace(parameters=[first, *signature.parameters.values()])
    except (TypeError, ValueError):  # a callable without a signature: inspect shows the wrapper's
        pass
    return types.MethodType(function, module)


def _call_uncompiled_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._torchbay_uncompiled_forward(*args, **kwargs)


# --- the settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileSettings:
    """What ``torch.compile`` gets, and whether to compile regions (repeated blocks) only."""

    backend: str = DEFAULT_BACKEND
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict = field(default_factory=dict)
    regional: bool = False

    @classmethod
    def from_section(cls, section: Any) -> "CompileSettings":
        return cls(backend=section.backend, mode=section.mode, fullgraph=section.fullgraph, dynamic=section.dynamic,
                   options=dict(section.options), regional=section.regional)

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = dict(self.options)
        return out

    def describe(self) -> str:
        parts = [f"backend={self.backend}"] + [f"{k}={v}" for k, v in (("mode", self.mode), ("dynamic", self.dynamic))
                                               if v is not None]
        return ", ".join(parts + (["fullgraph"] if self.fullgraph else []))


def section_problems(section: Any) -> list[str]:
    """Problems with the ``compile`` section, found before any process group starts."""
    problems = []
    if section.mode is not None and section.options:
        problems.append("compile.mode and compile.options cannot both be set (torch.compile takes one or the "
                        "other); move the mode's settings into compile.options or drop compile.options")
    if section.enabled is True or section.backend != DEFAULT_BACKEND:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if section.backend not in known:
            problems.append(f"compile.backend '{section.backend}' is not a torch.compile backend here (known: "
                            f"{', '.join(known)}); register it with torch._dynamo.register_backend or pick one")
    return problems


# --- the step of prepare -------------------------------------------------------------------------


class ModelCompiler:
    """Compiles prepared models as the ``compile`` section says (one per Accelerator)."""

    def __init__(self, section: Any, strategy: Any, precision: Any):
        self.enabled = section.enabled
        self.settings = CompileSettings.from_section(section)
        self.strategy = strategy
        self.precision = precision
        #: per compiled model, in prepare order: the names of the modules compiled in place
        self.compiled: list[list[str]] = []

    def reason(self, module: torch.nn.Module) -> str | None:
        """Why ``module`` (the user's) is compiled, or ``None`` when it is not."""
        if self.enabled is True:
            return "compile.enabled: true"
        if self.enabled is False:
            return None
        why = self.precision.compile_reason(module)
        return f"{why} (compile.enabled: auto; false turns it off)" if why else None

    def compile(self, model: Any) -> Any:
        """Compile the strategy's targets of the prepared ``model`` in place; return ``model``."""
        inner = self.strategy.unwrap_model(model)
        why = self.reason(inner)
        if why is None:
            return model
        targets = self.strategy.compile_targets(model, regional=self.settings.regional)
        if self.settings.regional and not targets:
            log.warning("compile.regional: %s has no repeated blocks (a ModuleList of one class); compiling it whole",
                        type(inner).__name__)
            targets = self.strategy.compile_targets(model, regional=False)
        names = {id(m): name for name, m in inner.named_modules()}
        done = []
        for target in targets:
            if not is_compiled(target):
                compile_in_place(target, **self.settings.kwargs())
                done.append(names.get(id(target), type(target).__name__) or "<root>")
        self.compiled.append(done)
        if done and self.strategy.rank == 0:
            what = done[0] if len(done) == 1 else f"{len(done)} modules ({done[0]} ... {done[-1]})"
            log.info("compile: %s of %s compiled in place with torch.compile(%s) because %s; the first steps "
                     "(and each new input shape) include compiling", what, type(inner).__name__,
                     self.settings.describe(), why)
        return model


# --- Accelerate's names -----------------------------------------------------------------------


class DynamoBackend(str, enum.Enum):
    """Accelerate's ``DynamoBackend``: a ``torch.compile`` backend by name (``NO``: do not compile)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"


def _backend_name(backend: Any) -> str | None:
    """A torch.compile backend name from Accelerate's value; ``None`` for no compiling."""
    if backend is None:
        return None
    name = str(getattr(backend, "value", backend)).lower()
    return None if name == "no" else name


@dataclass
class TorchDynamoPlugin:
    """Accelerate's ``TorchDynamoPlugin``, taken as the ``compile`` config section.

    ``backend`` unset or ``"no"`` sets nothing (transformers' Trainer always passes
    ``TorchDynamoPlugin(backend=None)``): the config's ``compile.enabled`` stands, whose default
    compiles only where the precision needs it. As Accelerate's, a setting left ``None`` is read
    from ``ACCELERATE_DYNAMO_BACKEND`` / ``_MODE`` / ``_USE_FULLGRAPH`` / ``_USE_DYNAMIC`` /
    ``_USE_REGIONAL_COMPILATION`` when set (what ``accelerate launch --dynamo_*`` sets for the
    script); ``TORCHBAY_COMPILE__*`` sets the same keys for torchbay's own config.
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self):
        env = {key: os.environ.get(f"ACCELERATE_DYNAMO_{name}") for key, name in _DYNAMO_ENVIRONMENT.items()}
        if self.backend is None and env["backend"]:
            self.backend = env["backend"]
        if self.mode is None and env["mode"]:
            self.mode = env["mode"]
        for key in ("fullgraph", "dynamic", "use_regional_compilation"):
            if getattr(self, key) is None and env[key] is not None:
                setattr(self, key, _environment_flag(f"ACCELERATE_DYNAMO_{_DYNAMO_ENVIRONMENT[key]}", env[key]))

    def to_config(self) -> dict[str, Any]:
        if self.disable:
            return {"compile.enabled": False}
        backend = _backend_name(self.backend)
        if backend is None:
            return {}
        out: dict[str, Any] = {"compile.enabled": True, "compile.backend": backend}
        for key, value in (("mode", self.mode), ("fullgraph", self.fullgraph), ("dynamic", self.dynamic),
                           ("options", self.options), ("regional", self.use_regional_compilation)):
            if value is not None and not (key == "mode" and value == "default"):
                out[f"compile.{key}"] = value
        return out

    def to_kwargs(self) -> dict[str, Any]:
        """The settings that differ from a default plugin's, as Accelerate's ``to_kwargs`` gives them (the backend
        by its lower-case name; ``use_regional_compilation`` left out): what ``torch.compile`` gets besides its
        defaults."""
        defaults = {"backend": None, "mode": None, "fullgraph": False, "dynamic": None, "options": None,
                    "disable": False}
        given = {"backend": _backend_name(self.backend), "mode": None if self.mode == "default" else self.mode,
                 "fullgraph": bool(self.fullgraph), "dynamic": self.dynamic, "options": self.options,
                 "disable": self.disable}
        return {key: value for key, value in given.items() if value != defaults[key]}


#: TorchDynamoPlugin's fields read from ``ACCELERATE_DYNAMO_<name>`` when left None
_DYNAMO_ENVIRONMENT = {"backend": "BACKEND", "mode": "MODE", "fullgraph": "USE_FULLGRAPH", "dynamic": "USE_DYNAMIC",
                       "use_regional_compilation": "USE_REGIONAL_COMPILATION"}


def _environment_flag(name: str, value: str) -> bool:
    try:
        return bool(str_to_bool(value.strip(), to_bool=True))
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a boolean; set it to true or false (or unset it)") from None


def dynamo_arguments(dynamo_backend: Any, dynamo_plugin: Any) -> dict[str, Any]:
    """Dotted config values for ``Accelerator(dynamo_backend=..., dynamo_plugin=...)``."""
    if dynamo_plugin is not None and not hasattr(dynamo_plugin, "to_config"):
        raise ConfigError(f"Accelerator(dynamo_plugin=...) takes torchbay.utils.TorchDynamoPlugin, not "
                          f"{type(dynamo_plugin).__module__}.{type(dynamo_plugin).__name__}")
    from_plugin = dynamo_plugin.to_config() if dynamo_plugin is not None else {}
    backend = _backend_name(dynamo_backend)
    if backend is not None and from_plugin:
        raise ConfigError("Accelerator() got both dynamo_backend and dynamo_plugin; give the backend in the plugin")
    return {"compile.enabled": True, "compile.backend": backend} if backend else from_plugin


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Accelerate's regional compilation: a twin of ``module`` whose repeated blocks are each wrapped by
    ``torch.compile`` (so that one compiled graph serves them all) and whose parts outside them are compiled
    whole; a module without repeated blocks is compiled whole.

    ``module`` is left as it was: the twin is a new object of the same class sharing its parameters and
    buffers, its methods bound to ``module`` rebound to the twin, and it keeps ``module`` as ``_orig_mod``
    (``unwrap_model`` returns it). ``prepare`` compiles in place instead (:class:`ModelCompiler`).
    """
    twin = _regional_twin(module, compile_kwargs)
    twin.__dict__.setdefault("_orig_mod", module)
    return twin


def _regional_twin(module: torch.nn.Module, compile_kwargs: dict[str, Any]) -> torch.nn.Module:
    if is_repeated_blocks(module):
        return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if not repeated_blocks(module):
        return torch.compile(module, **compile_kwargs)
    twin = module.__class__.__new__(module.__class__)
    twin.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():  # a forward patched onto the instance runs on the twin
        if getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            twin.__dict__[name] = types.MethodType(value.__func__, twin)
    twin._modules = {}
    for name, child in module._modules.items():
        twin._modules[name] = None if child is None else _regional_twin(child, compile_kwargs)
    return twin


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether a submodule of ``module`` is compiled (``torch.compile`` or in place)."""
    return any(is_compiled(m) for m in module.modules() if m is not module)
