"""Write docs/accelerate-compat.md: every public name of Accelerate and accelerate.utils, and torchbay's answer.

    python docs/generate_accelerate_compat.py          # rewrite the file
    python docs/generate_accelerate_compat.py --check  # exit 1 when the file is stale

The name lists come from the installed Accelerate (a dev dependency, ``accelerate==1.15.*``);
each name's status is what torchbay does when asked for it, so the table cannot drift from the
code: ``tests/compat_api/test_accelerate_compat_docs.py`` checks both.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE / "accelerate-compat.md"

#: the Hugging Face libraries' names (tests/compat_hf/accelerate_names.yaml) and the last `make compat-hf` tables
LIBRARY_NAMES = HERE.parent / "tests" / "compat_hf" / "accelerate_names.yaml"
COMPAT_HF_RESULTS = HERE / "compat-hf-results.md"


def modules() -> list[tuple[str, str]]:
    """Accelerate module -> the torchbay module that answers it (the switch's own table), then the command modules
    a plugin answers (its accelerate.yaml, ``api: commands``; the distribution from the published catalog)."""
    from torchbay.registry.published import ACCELERATE_COMMAND, distribution_for
    from torchbay.switch.finder import MODULES, PLUGIN_COMMAND_MODULES

    served = [(a if a != "accelerate.utils" else "accelerate.utils (and its submodules)", f"`{t}`")
              for a, t in MODULES.items()]
    by_plugin = [(a, f"the {distribution_for(ACCELERATE_COMMAND, c)} plugin's module (`accelerate {c}`)")
                 for a, c in PLUGIN_COMMAND_MODULES.items()]
    return sorted(served + by_plugin)


#: names that behave differently from Accelerate's in a way a user may notice
NOTES = {
    "AlignDevicesHook": "`torchbay.compat.hooks.AlignDevicesHook`, the hook "
                        "dispatch_model/cpu_offload/disk_offload attach; "
                        "where it differs (ties lent, failed forwards, removal of disk offload) see "
                        "docs/big-model-inference.md#hooks",
    "Accelerator": "one process group per process, but each Accelerator keeps its own settings and gradient "
                   "state; arguments torchbay does not take raise a ConfigError naming the config key to use",
    "PartialState": "shared per process as in Accelerate; joins the process group from torchbay's config",
    "DistributedType": "member chosen from the selected strategy and device (single: NO, ddp: MULTI_<DEVICE>, "
                       "another strategy: its name); torchbay's own name is accelerator.strategy.name",
    "DataLoaderConfiguration": "use_stateful_dataloader=True needs no torchdata: torchbay's prepared loaders "
                               "always save their position; the flag makes iteration resume after load_state",
    "notebook_launcher": "elastic launch with forked workers, on the device the config selects (any device plugin); "
                         "on one machine, a free port when use_port is left unset and 29500 is taken",
    "debug_launcher": "notebook_launcher on the cpu device",
    "gather": "collectives do not carry gradients: a tensor that requires grad is gathered as its data",
    "is_fp16_available": "whether the current (or auto-selected) device plugin autocasts fp16",
    "is_bf16_available": "whether the current (or auto-selected) device plugin autocasts bf16",
    "set_seed": "also seeds the generators of every live device backend",
    "tqdm": "also accepts Accelerate's old tqdm(main_process_only, iterable) form; when stderr is not a terminal "
            "(CI, SLURM, nohup) it prints a few whole lines (the start, each further 10% or every 30 s, the end) "
            "instead of a redrawn bar",
    "synchronize_rng_states": "'torch', 'generator' or the run's device name; other devices are skipped",
    "TorchDynamoPlugin": "taken as the compile config section; backend unset or 'no' sets nothing (compile.enabled "
                         "stays auto: off, except where the precision needs it, e.g. torchao FP8); settings left "
                         "None read ACCELERATE_DYNAMO_* as Accelerate's do (TORCHBAY_COMPILE__* sets the config)",
    "compile_regions": "a twin sharing the parameters, each repeated block wrapped by torch.compile and the rest "
                       "compiled whole, the user's module unchanged (prepare with compile.regional compiles in "
                       "place instead)",
    "has_compiled_regions": "also counts modules compiled in place (Module.compile, torchbay's compile step)",
    "is_compiled_module": "True for a torch.compile wrapper (OptimizedModule) only: a model torchbay's compile step "
                          "compiled in place has no _orig_mod to unwrap, so code that unwraps one leaves it as is",
    "LoggerType": "ALL and one member per installed tracker (a tracker plugin, or the built-in JSONL); a "
                  "member that is not installed raises, naming the distribution to install (docs/tracking.md)",
}


def public_names(module: types.ModuleType) -> list[str]:
    return sorted(n for n in dir(module) if not n.startswith("_")
                  and not isinstance(getattr(module, n), types.ModuleType))


def accelerate_names() -> dict[str, list[str]]:
    import accelerate
    import accelerate.hooks
    import accelerate.utils

    hooks = [n for n in public_names(accelerate.hooks)  # what accelerate.hooks defines, not what it imports
             if getattr(getattr(accelerate.hooks, n), "__module__", None) == "accelerate.hooks"]
    return {"accelerate": public_names(accelerate), "accelerate.utils": public_names(accelerate.utils),
            "accelerate.hooks": hooks}


def status(name: str, where: str) -> tuple[str, str]:
    """``(status, torchbay's answer)`` for an Accelerate name, found by asking torchbay."""
    import importlib

    import torchbay.compat.names as cn
    from torchbay.compat import library_names

    module = importlib.import_module({"accelerate": "torchbay", "accelerate.hooks": "torchbay.compat.hooks"}.get(
        where, "torchbay.utils"))
    plugin = cn._table().get("plugin_names", {}).get(name)
    if plugin:
        return "plugin-provided", f"from {plugin['install']} when installed ({plugin['module']})"
    entry = cn.unsupported().get(name)
    if entry:
        if name in library_names.placeholders():
            return "placeholder", f"imports (a Hugging Face library imports it); using it raises: {entry['advice']}"
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


def library_section() -> list[str]:
    """What transformers, peft, trl and diffusers import from accelerate, and the last `make compat-hf` tables."""
    import importlib

    import yaml

    from torchbay.switch import finder

    names = yaml.safe_load(LIBRARY_NAMES.read_text(encoding="utf-8"))
    lines = [
        "## The Hugging Face libraries",
        "",
        "Turn the switch on and run the libraries as their users do: `TORCHBAY_AS_ACCELERATE=1 python train.py`,",
        "`TORCHBAY_AS_ACCELERATE=1 torchrun ...`, `torchbay launch --as-accelerate --num-processes 2 train.py`, or",
        "`--strategy fsdp` / a DeepSpeed JSON as the library takes them. The switch is the installed",
        "`torchbay_as_accelerate.pth` (it does nothing unless the variable is set) plus a meta-path finder and a",
        "distribution finder (torchbay/switch/finder.py): `accelerate.__version__` and",
        f"`importlib.metadata.version(\"accelerate\")` are `{finder.ACCELERATE_API_LEVEL}+torchbay<version>`, the",
        "Accelerate API level torchbay implements. It works whether or not the real Accelerate is installed",
        "(only `accelerate.test_utils`, Accelerate's own test helpers, needs it); without the switch nothing changes.",
        "",
        "Every name these libraries import from accelerate (read from their sources, module level and inside",
        "functions, by tests/compat_hf/scan_accelerate_names.py; tests/compat_api/test_compat_switch.py imports each):",
        "",
        "| library | names | resolve on torchbay |",
        "|---|---|---|",
    ]
    resolved = _resolved_with_the_switch()
    for library, modules_of in names.items():
        count = sum(len(v) for v in modules_of.values())
        shown = "all" if resolved[library] == count else f"{resolved[library]} of {count}"
        lines.append(f"| {library} | {count} in {len(modules_of)} modules | {shown} |")
    placeholders = sorted(importlib.import_module("torchbay.compat.library_names").placeholders())
    lines += ["", "Names served by a plugin: while that plugin is not installed each is a placeholder "
                  "that imports and,",
              "when used, says which distribution to install: " + ", ".join(f"`{n}`" for n in placeholders) + ".",
              ""]
    if COMPAT_HF_RESULTS.is_file():
        lines += COMPAT_HF_RESULTS.read_text(encoding="utf-8").strip().splitlines() + [""]
    return lines


def _resolved_with_the_switch() -> dict[str, int]:
    """``{library: names that resolve}``, asked in a fresh interpreter with the switch on."""
    import json
    import os
    import subprocess

    env = {**os.environ, "TORCHBAY_AS_ACCELERATE": "1"}
    done = subprocess.run([sys.executable, str(LIBRARY_NAMES.with_name("scan_accelerate_names.py")), "--resolve"],
                          capture_output=True, text=True, env=env, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {library: n - sum(1 for m in report["missing"] if m.startswith(f"{library}: "))
            for library, n in report["count"].items()}


def render() -> str:
    names = accelerate_names()
    lines = [
        "# Accelerate compatibility",
        "",
        "<!-- generated by docs/generate_accelerate_compat.py from the installed Accelerate; do not edit -->",
        "",
        "torchbay follows Hugging Face Accelerate's user API: a script moves over by changing its imports.",
        "Libraries built on Accelerate (transformers' Trainer, peft, trl, diffusers) move over with no change at",
        "all: with `TORCHBAY_AS_ACCELERATE=1` in the environment (or `torchbay launch --as-accelerate`, the config",
        "key `launch.as_accelerate`, or `torchbay.compat.as_accelerate()` before those libraries are imported),",
        "torchbay answers `import accelerate` (see \"The Hugging Face libraries\" below).",
        "",
        "The judge is Accelerate 1.15's own test scripts (`accelerate/test_utils/scripts/`), run on torchbay",
        "with every `accelerate` import served by torchbay (the same switch): `make compat` (tests/compat/) "
        "runs each test",
        "function with 1 and 2 processes under `torchbay launch`, then each script's whole `main()`, and",
        "prints a table; a function Accelerate itself cannot pass on a CPU-only machine is listed as skipped",
        "with the reason (tests/compat/cases.py). `python tests/compat/run.py --accelerate` runs the same",
        "cases on Accelerate itself. A function that hangs (past 180 s: its ranks' stacks are written) or",
        "takes the processes down runs once more, alone; one that passes only then is listed as flaky at",
        "the end of the output with the first attempt's error and stacks, and one that fails twice fails.",
        "",
        "The second judge is Accelerate 1.15's whole test suite (the `tests/` of its source archive, fetched by pip",
        "at run time): `make compat-suite` (also part of `make compat`, tests/compat_suite/) runs each file on",
        "Accelerate and under the switch side by side and writes [accelerate-suite.md](accelerate-suite.md): per",
        "file, the counts on each side, and each test that passes on Accelerate and not on torchbay, with its first",
        "error line and whether it is refused on purpose (what a user loses, why, what to use instead) or a",
        "difference still to fix. A loss in neither list fails the run.",
        "",
        "## Modules",
        "",
        "| Accelerate | torchbay |",
        "|---|---|",
        *[f"| `{a}` | {t} |" for a, t in modules()],
        "",
        "Accelerate's test fixtures (`accelerate.test_utils`: RegressionModel, RegressionDataset...) are",
        "Accelerate's own code; the compat suite imports them from the installed package.",
        "",
        "## Behaviour worth knowing",
        "",
        "- `pad_input_tensors(tensor, batch_size, num_processes, dim)` pads along `dim` with zeros up to the next",
        "  multiple of `num_processes` (at least one row a process). Accelerate 1.15's formula can give a size that",
        "  is not a multiple (batch 7 over 2 processes: 9) and always pads dim 0; the two agree wherever Accelerate's",
        "  result is a multiple (tests/data/test_operations_accelerate.py).",
        "- `save_state(safe_serialization=False)` writes the weights as `model_<i>.bin`, which torchbay reads back",
        "  weights-only; `save_model(..., safe_serialization=False)` writes Accelerate's `pytorch_model.bin` files",
        "  (torchbay's mark is one JSON record of each zip archive: it replaces only its own weights files).",
        "- A prepared `DataLoader` is a `torch.utils.data.DataLoader` and serves Accelerate's batches at the same",
        "  seed: with one process the unprepared loader's order; with several, a `RandomSampler` without a",
        "  generator gets one at `prepare()` (drawn from the global RNG, as Accelerate draws it) whose state",
        "  process 0 sends to all at each epoch; `use_seedable_sampler` orders by `data_seed` + epoch. Sharding,",
        "  padding of the last round, lengths (none for a streaming dataset), `set_epoch` and `remainder` follow",
        "  Accelerate 1.15 (tests/data/test_data_accelerate.py compares them at 1 and 2 processes). On top of",
        "  Accelerate, resuming mid-epoch (`load_state` + `skip_first_batches`, or plain iteration with",
        "  `use_stateful_dataloader=True`) serves the same batches as the uninterrupted run, and the epoch served",
        "  through `skip_first_batches` counts as the loader's own. `prepare()` gives an object it prepared before",
        "  back unchanged.",
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
        "- `gather_for_metrics` cuts the samples that are not real at the end of a loader, in one process too: an",
        "  epoch's short last batch keeps its real size even when a loop gathers more rows than samples (Trainer",
        "  gathers each batch's loss repeated to the batch size, so its `eval_loss` matches Accelerate's).",
        "- A loop that decides gradient sync by itself (transformers' Trainer) calls",
        "  `accelerator.gradient_state._set_sync_gradients(...)` and reads `gradient_state.plugin_kwargs`;",
        "  `GradientAccumulationPlugin(adjust_scheduler=True)` (the default) counts the micro-batches that do not step",
        "  in a prepared scheduler's `_step_count`, as Accelerate does.",
        "- Free functions (`gather`, `reduce`, `broadcast`, `pad_across_processes`...) act on the process",
        "  group through the current state; `reduce` defaults to `mean` as Accelerate's does",
        "  (`accelerator.reduce` to `sum`). With `PartialState().debug = True` shapes are compared first and a",
        "  mismatch raises `DistributedOperationException`.",
        "- `accelerate.commands.launch.launch_command_parser()` gives Accelerate's namespace (`multi_gpu`, `use_fsdp`,",
        "  `num_processes`, `training_script`...), made from `torchbay launch`'s flags and the Accelerate tables",
        "  (`resources/accelerate.yaml` and each plugin's); `_validate_launch_command` completes it from the config",
        "  file the launch reads, as Accelerate does (a key neither knows is refused), and `launch_command` runs",
        "  `torchbay launch --as-accelerate` with the flags the namespace was given or changed to (trl's CLI sets",
        "  `training_script_args` after parsing). `prepare_simple_launcher_cmd_env` gives an `mpirun_config`'s",
        "  `mpirun` command line in the installed MPI's spelling, and `--cpu` the Intel OpenMP variables",
        "  (`KMP_AFFINITY`, `KMP_BLOCKTIME`; values already set are kept).",
        "",
        "## Checkpoints Accelerate wrote",
        "",
        "- `accelerator.load_state(dir)` reads a folder written by Accelerate's `save_state` (no",
        "  `torchbay_manifest.json`, Accelerate's `random_states_N.pkl` and weights), so a run moves to torchbay",
        "  mid-training: `model[_i].safetensors` (or `pytorch_model[_i].bin`; DDP's `module.` prefix dropped),",
        "  `optimizer[_i].bin`, `scheduler[_i].bin`, `custom_checkpoint_N.pkl`, `scaler.pt` and each rank's RNG",
        "  state, on strategies that keep full state (single, ddp). Pickles are read with torch's weights-only",
        "  loader, the RNG files with an allow-list that adds NumPy arrays of numbers and nothing else",
        "  (docs/checkpoint-guarantees.md); every file is read on every rank before anything changes.",
        "  `sampler.bin` and `dl_state_dict.bin` (a pickled sampler object, another loader's positions) are",
        "  refused, naming the file: without them each loader starts its epoch, as Accelerate's map-style",
        "  loaders do, and `skip_first_batches` skips ahead. `save_state` always writes torchbay's layout.",
        "  Tested against Accelerate 1.15 at 1 and 2 processes: the same losses, bit for bit.",
        "- With torchbay-fsdp, `accelerator.state.fsdp_plugin` is the `FullyShardedDataParallelPlugin` given",
        "  (or one built from the `fsdp` section), and `save_fsdp_model`/`load_fsdp_model`/",
        "  `save_fsdp_optimizer`/`load_fsdp_optimizer` (Accelerate's signatures) write and read Accelerate's",
        "  files: `pytorch_model_fsdp.bin`/`optimizer.bin` (FULL_STATE_DICT, rank 0) or DCP folders",
        "  `pytorch_model_fsdp_0/`/`optimizer_0/` (SHARDED_STATE_DICT), each readable by the other; a file or",
        "  folder torchbay did not write is never overwritten. transformers' Trainer with `fsdp=...` runs on CPU",
        "  (Accelerate 1.15 runs its FSDP plugin on GPUs only: with `use_cpu` its Trainer runs DDP).",
        "",
        "## Statuses",
        "",
        "- **same**: the name exists with Accelerate's signature and meaning.",
        "- **plugin-answered**: `is_*_available()` and capability checks, answered by the installed plugins.",
        "- **plugin-provided**: a backend's name, re-exported from its plugin (the distribution named).",
        "- **refused**: torchbay does it another way; `torchbay.utils.X` is a missing attribute whose error",
        "  (`UnsupportedAPIError`, an AttributeError) says which. Under the switch every name of Accelerate's",
        "  modules imports (`from accelerate.utils import X` never fails for a name Accelerate has): a refused",
        "  name is a placeholder there, a class that cannot be built, a function that cannot be called or an",
        "  object whose attributes cannot be read, each raising that error; Accelerate's constants keep their",
        "  values and its enums their members (compat/resources/accelerate_surface.yaml, written by",
        "  scripts/scan_accelerate_surface.py), and `accelerate.__file__` is the installed Accelerate's file.",
        "- **not-planned**: outside torchbay's scope; the same missing attribute, saying why.",
        "- **placeholder**: refused, but transformers, peft, trl or diffusers import it: a class that cannot be",
        "  built or a function that cannot be called, whose error says what to do instead.",
        "",
        "With every torchbay plugin installed (as when this table is generated), no Accelerate name gives a",
        "plain AttributeError or a silently different value. A backend's Accelerate names come from its plugin",
        "(the `accelerate.yaml` in its package, which the plugin manager reads; so does its part of",
        "`torchbay config import-accelerate`): without that plugin, its plugin-provided and refused names are",
        "not offered (AttributeError, as for any name torchbay does not know), a device's `is_<name>_available()`",
        "answers whether a library of that name is installed (as Accelerate's `is_deepspeed_available()` does),",
        "and the config import reports its `distributed_type` or nested config as not imported, saying which",
        "kind of plugin to install.",
        "",
    ]
    lines += library_section()
    for where in ("accelerate", "accelerate.utils", "accelerate.hooks"):
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
