"""Write docs/accelerate-compat.md: every public name of Accelerate and accelerate.utils, and torchbay's answer.

    python docs/generate_accelerate_compat.py          # rewrite the file
    python docs/generate_accelerate_compat.py --check  # exit 1 when the file is stale

The name lists come from the installed Accelerate (a dev dependency, ``accelerate==1.15.*``);
each name's status is what torchbay does when asked for it, so the table cannot drift from the
code: ``tests/test_accelerate_compat_docs.py`` checks both.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE / "accelerate-compat.md"

#: Accelerate module -> torchbay module (what tests/compat/redirect.py aliases)
MODULES = [("accelerate", "torchbay"), ("accelerate.accelerator", "torchbay.accelerator"),
           ("accelerate.state", "torchbay.state"), ("accelerate.data_loader", "torchbay.data"),
           ("accelerate.utils (and its submodules)", "torchbay.utils"), ("accelerate.logging", "torchbay.utils"),
           ("accelerate.launchers", "torchbay.launchers"),
           ("accelerate.optimizer, accelerate.scheduler", "torchbay.wrappers"),
           ("accelerate.tracking", "torchbay.tracking"), ("accelerate.big_modeling", "torchbay.big_modeling"),
           ("accelerate.parallelism_config", "torchbay.parallelism_config")]

#: names that behave differently from Accelerate's in a way a user may notice
NOTES = {
    "Accelerator": "one process group per process, but each Accelerator keeps its own settings and gradient "
                   "state; arguments torchbay does not take raise a ConfigError naming the config key to use",
    "PartialState": "shared per process as in Accelerate; joins the process group from torchbay's config",
    "DistributedType": "member chosen from the selected strategy and device (single: NO, ddp: MULTI_<DEVICE>, "
                       "another strategy: its name); torchbay's own name is accelerator.strategy.name",
    "DataLoaderConfiguration": "use_stateful_dataloader=True needs no torchdata: torchbay's prepared loaders "
                               "always save their position; the flag makes iteration resume after load_state",
    "GradientAccumulationPlugin": "sync_with_dataloader=False is refused (torchbay always syncs at the end of "
                                  "a loader)",
    "notebook_launcher": "elastic launch with forked workers, on the device the config selects (any device plugin); "
                         "on one machine, a free port when use_port is left unset and 29500 is taken",
    "debug_launcher": "notebook_launcher on the cpu device",
    "gather": "collectives do not carry gradients: a tensor that requires grad is gathered as its data",
    "is_fp16_available": "whether the current (or auto-selected) device plugin autocasts fp16",
    "is_bf16_available": "whether the current (or auto-selected) device plugin autocasts bf16",
    "set_seed": "also seeds the generators of every live device backend",
    "tqdm": "also accepts Accelerate's old tqdm(main_process_only, iterable) form",
    "synchronize_rng_states": "'torch', 'generator' or the run's device name; other devices are skipped",
    "TorchDynamoPlugin": "taken as the compile config section; backend unset or 'no' sets nothing (compile.enabled "
                         "stays auto: off, except where the precision needs it, e.g. torchao FP8); reads no "
                         "ACCELERATE_DYNAMO_* variable (TORCHBAY_COMPILE__* instead)",
    "compile_regions": "compiles the repeated blocks in place and returns the same module (Accelerate returns a "
                       "copy and also compiles the other leaf modules)",
    "has_compiled_regions": "also counts modules compiled in place (Module.compile, torchbay's compile step)",
    "LoggerType": "ALL and one member per installed tracker (a tracker plugin, or the built-in JSONL); a "
                  "member that is not installed raises, naming the distribution to install (docs/tracking.md)",
}


def public_names(module: types.ModuleType) -> list[str]:
    return sorted(n for n in dir(module) if not n.startswith("_")
                  and not isinstance(getattr(module, n), types.ModuleType))


def accelerate_names() -> dict[str, list[str]]:
    import accelerate
    import accelerate.utils

    return {"accelerate": public_names(accelerate), "accelerate.utils": public_names(accelerate.utils)}


def status(name: str, where: str) -> tuple[str, str]:
    """``(status, torchbay's answer)`` for an Accelerate name, found by asking torchbay."""
    import importlib

    import torchbay.compat_names as cn

    module = importlib.import_module("torchbay" if where == "accelerate" else "torchbay.utils")
    plugin = cn._table().get("plugin_names", {}).get(name)
    if plugin:
        return "plugin-provided", f"from {plugin['install']} when installed ({plugin['module']})"
    entry = cn.unsupported().get(name)
    if entry:
        return entry["status"], entry["advice"]
    if name.startswith("is_") and name.endswith("_available"):
        return "plugin-answered", NOTES.get(name, "answered by the installed plugins (device, strategy or fp8 "
                                                  "engine) or by whether the library is installed")
    if name.startswith("check_") and name.endswith("_fp8_capability"):
        return "plugin-answered", "the device plugin's compute capability (8.9 or more)"
    try:
        value = getattr(module, name)
    except Exception as exc:  # pragma: no cover - the test reports it
        return "MISSING", f"{type(exc).__name__}: {exc}"
    home = getattr(value, "__module__", None) or module.__name__
    return "same", NOTES.get(name, f"`{module.__name__}.{name}` ({home})")


def render() -> str:
    names = accelerate_names()
    lines = [
        "# Accelerate compatibility",
        "",
        "<!-- generated by docs/generate_accelerate_compat.py from the installed Accelerate; do not edit -->",
        "",
        "torchbay follows Hugging Face Accelerate's user API: a script moves over by changing its imports.",
        "The judge is Accelerate 1.15's own test scripts (`accelerate/test_utils/scripts/`), run on torchbay",
        "with every `accelerate` import redirected at run time: `make compat` (tests/compat/) runs each test",
        "function with 1 and 2 processes under `torchbay launch`, then each script's whole `main()`, and",
        "prints a table; a function Accelerate itself cannot pass on a CPU-only machine is listed as skipped",
        "with the reason (tests/compat/cases.py). `python tests/compat/run.py --accelerate` runs the same",
        "cases on Accelerate itself. A function that hangs (past 180 s: its ranks' stacks are written) or",
        "takes the processes down runs once more, alone; one that passes only then is listed as flaky at",
        "the end of the output with the first attempt's error and stacks, and one that fails twice fails.",
        "",
        "## Modules",
        "",
        "| Accelerate | torchbay |",
        "|---|---|",
        *[f"| `{a}` | `{t}` |" for a, t in MODULES],
        "",
        "Accelerate's test fixtures (`accelerate.test_utils`: RegressionModel, RegressionDataset...) are",
        "Accelerate's own code; the compat suite imports them from the installed package.",
        "",
        "## Behaviour worth knowing",
        "",
        "- A prepared `DataLoader` shuffles exactly as the unprepared one: the user's generator (or the global",
        "  RNG) is drawn where `RandomSampler` draws it, so adding `prepare()` to a seeded script does not change",
        "  its run; with several processes, process 0's draw is used by all. `use_seedable_sampler` is off by",
        "  default, as in Accelerate. Resuming mid-epoch (`load_state` + `skip_first_batches`, or plain",
        "  iteration with `use_stateful_dataloader=True`) serves the same batches as the uninterrupted run.",
        "- Under `mixed_precision` bf16/fp16 the prepared model's outputs come back in fp32 (Accelerate's",
        "  `convert_outputs_to_fp32`), so a loss computed outside the model matches a raw `torch.autocast` loop",
        "  bit for bit; `unwrap_model(model, keep_fp32_wrapper=False)` removes the wrapper.",
        "- `PartialState`/`AcceleratorState` are shared per process (the latest `Accelerator` fills them);",
        "  `accelerator.gradient_state` belongs to each `Accelerator`; `GradientState()` gives the latest one's.",
        "- `accelerator.distributed_type` is a `DistributedType` member; torchbay's own name for the strategy",
        "  is `accelerator.strategy.name`.",
        "- `Accelerator(dynamo_backend=...)` and `dynamo_plugin=TorchDynamoPlugin(...)` set the `compile` config",
        "  section (docs/configuration.md); `prepare` compiles in place, so the prepared model keeps its type and",
        "  `state_dict` keys (no `_orig_mod.`) and `unwrap_model` returns your module whatever `keep_torch_compile`",
        '  says. `dynamo_backend="no"` and `TorchDynamoPlugin(backend=None)` (transformers\' Trainer) compile nothing,',
        "  except a model whose precision needs compiling (torchao FP8 on FP8 hardware; `compile.enabled: false`).",
        "- Free functions (`gather`, `reduce`, `broadcast`, `pad_across_processes`...) act on the process",
        "  group through the current state; `reduce` defaults to `mean` as Accelerate's does",
        "  (`accelerator.reduce` to `sum`). With `PartialState().debug = True` shapes are compared first and a",
        "  mismatch raises `DistributedOperationException`.",
        "",
        "## Statuses",
        "",
        "- **same**: the name exists with Accelerate's signature and meaning.",
        "- **plugin-answered**: `is_*_available()` and capability checks, answered by the installed plugins.",
        "- **plugin-provided**: a backend's name, re-exported from its plugin (the distribution named).",
        "- **refused**: torchbay does it another way; asking for the name raises `UnsupportedAPIError`",
        "  saying which.",
        "- **not-planned**: outside torchbay's scope; asking raises `UnsupportedAPIError` saying why.",
        "",
        "With every torchbay plugin installed (as when this table is generated), no Accelerate name gives a",
        "plain AttributeError or a silently different value. A backend's Accelerate names come from its plugin",
        "(the `accelerate.yaml` in its package, through the hook `torchbay_accelerate_mapping`, as does its part",
        "of `torchbay config import-accelerate`): without that plugin, its plugin-provided and refused names are",
        "not offered (AttributeError, as for any name torchbay does not know), a device's `is_<name>_available()`",
        "answers whether a library of that name is installed (as Accelerate's `is_deepspeed_available()` does),",
        "and the config import reports its `distributed_type` or nested config as not imported, saying which",
        "kind of plugin to install.",
        "",
    ]
    for where in ("accelerate", "accelerate.utils"):
        lines += [f"## `{where}` ({len(names[where])} names)", "", "| name | status | torchbay |", "|---|---|---|"]
        for name in names[where]:
            kind, answer = status(name, where)
            lines.append(f"| `{name}` | {kind} | {answer.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is stale: python docs/generate_accelerate_compat.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
