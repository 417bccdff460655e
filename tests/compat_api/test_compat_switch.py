"""The switch that makes torchbay answer ``import accelerate`` (issue 25; docs/accelerate-compat.md).

Each case runs in a fresh interpreter, as users turn the switch on: by ``TORCHBAY_AS_ACCELERATE=1`` before Python
starts (the installed ``torchbay_as_accelerate.pth`` reads it), by ``torchbay.compat.as_accelerate()``, or by
``torchbay launch --as-accelerate``. The real Accelerate is installed here, so "nothing changes without the switch"
is checked against it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = os.path.join(ROOT, "tests", "compat_hf", "accelerate_names.yaml")


def _python(code: str, switch: bool, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env.update(env_extra)
    if switch:
        env["TORCHBAY_AS_ACCELERATE"] = "1"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PROBE = """
    import importlib.metadata, importlib.util, json, accelerate
    print(json.dumps({"module": repr(accelerate), "version": accelerate.__version__,
                      "metadata": importlib.metadata.version("accelerate"),
                      "found": importlib.util.find_spec("accelerate") is not None}))
"""


def test_without_the_switch_import_accelerate_is_the_real_one():
    seen = _python(PROBE, switch=False)
    assert "site-packages" in seen["module"] and "torchbay" not in seen["module"]
    assert seen["version"] == seen["metadata"] and not seen["version"].endswith("torchbay0.1.0")


def test_the_environment_switch_serves_accelerate_from_interpreter_start():
    seen = _python(PROBE + """
    from accelerate import Accelerator
    from accelerate.utils import gather, DistributedType
    import torchbay
    assert Accelerator is torchbay.Accelerator and gather is torchbay.utils.gather
    """, switch=True)
    import torchbay

    assert "torchbay stand-in" in seen["module"] and seen["found"]
    assert seen["version"] == seen["metadata"] == f"1.15.0+torchbay{torchbay.__version__}"


def test_as_accelerate_switches_this_process_and_the_processes_it_starts():
    seen = _python("""
    import json, subprocess, sys
    import torchbay.compat
    torchbay.compat.as_accelerate()
    import accelerate
    child = subprocess.run([sys.executable, "-c", "import accelerate; print(repr(accelerate))"],
                           capture_output=True, text=True).stdout.strip()
    print(json.dumps({"here": repr(accelerate), "child": child}))
    """, switch=False)
    assert "torchbay stand-in" in seen["here"] and "torchbay stand-in" in seen["child"]


def test_as_accelerate_after_the_real_accelerate_was_imported_says_how_to_fix_it():
    seen = _python("""
    import json, accelerate, torchbay.compat
    from torchbay.errors import ConfigError
    try:
        torchbay.compat.as_accelerate()
        print(json.dumps({"error": None}))
    except ConfigError as exc:
        print(json.dumps({"error": str(exc)}))
    """, switch=False)
    assert "already imported" in seen["error"] and "TORCHBAY_AS_ACCELERATE=1" in seen["error"]


def test_without_accelerate_installed_the_switch_still_serves_it_and_its_test_helpers_say_what_to_install():
    seen = _python("""
    import json
    from torchbay.switch import finder
    finder._accelerate_dir = lambda: None  # as on a machine without the real Accelerate
    finder.as_accelerate()
    import accelerate
    from accelerate import Accelerator
    try:
        import accelerate.test_utils
        error = None
    except ImportError as exc:
        error = str(exc)
    print(json.dumps({"module": repr(accelerate), "error": error}))
    """, switch=False)
    assert "torchbay stand-in" in seen["module"] and "pip install accelerate" in seen["error"]


def test_every_name_the_hugging_face_libraries_import_from_accelerate_resolves():
    """tests/compat_hf/accelerate_names.yaml: read from transformers/peft/trl/diffusers sources."""
    names = yaml.safe_load(open(NAMES, encoding="utf-8"))
    assert set(names) == {"transformers", "peft", "trl", "diffusers"}
    seen = _python(f"""
    import json, sys
    sys.path.insert(0, {os.path.dirname(NAMES)!r})
    from scan_accelerate_names import resolve_kept_names
    report = resolve_kept_names()
    print(json.dumps({{"count": sum(report["count"].values()), "bad": report["missing"]}}))
    """, switch=True)
    assert seen["count"] > 100 and seen["bad"] == []


def test_a_name_torchbay_does_not_offer_imports_and_its_use_says_why():
    seen = _python("""
    import json, accelerate.utils, torchbay.utils
    from torchbay.errors import UnsupportedAPIError
    has = hasattr(accelerate.utils, "MegatronLMPlugin")
    from accelerate.utils import MegatronLMPlugin  # Accelerate's name: the import works
    try:
        MegatronLMPlugin()
        used = None
    except UnsupportedAPIError as exc:
        used = str(exc)
    try:
        torchbay.utils.MegatronLMPlugin  # torchbay's own module still refuses it at once
        attribute = None
    except AttributeError as exc:
        attribute = str(exc)
    try:
        from accelerate.utils import no_such_name_anywhere
        unknown = None
    except ImportError as exc:
        unknown = str(exc)
    print(json.dumps({"has": has, "used": used, "attribute": attribute, "unknown": unknown}))
    """, switch=True)
    assert seen["has"] is True
    assert "Megatron-LM is not a torchbay strategy" in seen["used"]
    assert "Megatron-LM is not a torchbay strategy" in seen["attribute"]
    assert "not offered by torchbay" in seen["unknown"]


def test_every_name_of_accelerates_surface_imports_under_the_switch():
    """Issue 36: no unserved name stops an import; constants keep Accelerate's values, enums their members, and
    a placeholder raises on use; ``accelerate.__file__`` is a file, as a package's is."""
    seen = _python("""
    import importlib, inspect, json, os
    from torchbay.switch import surface
    from torchbay.errors import UnsupportedAPIError
    failed, placeholders, refused = [], 0, 0
    for module, names in surface.table().items():
        try:
            imported = importlib.import_module(module)
        except Exception as exc:
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
            continue
        for name in names:
            try:
                value = getattr(imported, name)
            except Exception as exc:
                failed.append(f"{module}.{name}: {type(exc).__name__}: {exc}")
                continue
            if surface.is_placeholder(value):
                placeholders += 1
                try:
                    value()
                except UnsupportedAPIError as exc:
                    refused += "is not available on torchbay" in str(exc)
    from accelerate.utils.constants import FSDP2_STATE_DICT_TYPE
    from accelerate.commands.config.config_args import ComputeEnvironment
    import accelerate
    print(json.dumps({"failed": failed, "placeholders": placeholders, "refused": refused,
                      "file": os.path.isfile(accelerate.__file__), "getfile": inspect.getfile(accelerate),
                      "constant": FSDP2_STATE_DICT_TYPE, "member": ComputeEnvironment.LOCAL_MACHINE.value}))
    """, switch=True)
    assert seen["failed"] == []
    assert seen["placeholders"] > 0 and seen["refused"] == seen["placeholders"]
    assert seen["file"] and seen["getfile"].endswith("__init__.py")
    assert seen["constant"] == ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
    assert seen["member"] == "LOCAL_MACHINE"


def test_a_name_whose_plugin_is_not_installed_imports_and_its_use_names_the_distribution():
    seen = _python("""
    import json
    from accelerate.utils import save_fsdp_model, FullyShardedDataParallelPlugin
    from torchbay.compat.names import UnsupportedAPIError
    said = []
    for use in (lambda: save_fsdp_model(None, None, None, "out"), lambda: FullyShardedDataParallelPlugin()):
        try:
            use()
        except UnsupportedAPIError as exc:
            said.append(str(exc))
    print(json.dumps({"said": said, "isinstance": isinstance(object(), FullyShardedDataParallelPlugin)}))
    """, switch=True, TORCHBAY_BLOCK_PLUGINS="fsdp")
    assert len(seen["said"]) == 2 and all("pip install torchbay-fsdp" in s for s in seen["said"])
    assert seen["isinstance"] is False


def test_accelerate_commands_read_an_accelerate_config_file_and_parse_a_launch(tmp_path):
    config = tmp_path / "default_config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n")
    seen = _python(f"""
    import json
    from accelerate.commands.config import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    settings = load_config_from_file({str(config)!r}).to_dict()
    args = launch_command_parser().parse_args(["--num-processes", "2", "train.py", "--lr", "1"])
    print(json.dumps({{"settings": settings, "script": args.training_script, "script_args": args.training_script_args,
                       "num_processes": args.num_processes, "multi_gpu": args.multi_gpu}}))
    """, switch=True)
    assert seen["settings"]["num_processes"] == 2
    assert seen["script"] == "train.py" and seen["script_args"] == ["--lr", "1"]
    assert seen["num_processes"] == 2 and seen["multi_gpu"] is False  # Accelerate's namespace


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchbay_launch_as_accelerate_switches_every_worker(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import accelerate, os\nprint('PROBE', os.environ['RANK'], repr(accelerate), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    torchbay = os.path.join(os.path.dirname(sys.executable), "torchbay")
    runs = {}
    config = tmp_path / "hf.yaml"  # (a ./torchbay.yaml would be read by every launch here)
    config.write_text("launch:\n  as_accelerate: true\n")
    for label, flags in (("flag", ["--as-accelerate"]), ("config key", ["--config-file", str(config)]),
                         ("off", [])):
        done = subprocess.run([torchbay, "launch", "-q", "--num-processes", "2", *flags, str(script)],
                              capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[label] = sorted(line for line in done.stdout.splitlines() if line.startswith("PROBE"))
    for label in ("flag", "config key"):
        assert len(runs[label]) == 2 and all("torchbay stand-in" in line for line in runs[label]), runs[label]
    assert len(runs["off"]) == 2 and not any("torchbay" in line for line in runs["off"])


def test_a_plugins_accelerate_name_without_its_plugin_says_which_distribution_to_install():
    """Issue 28 item 4: TERecipeKwargs without torchbay-fp8, an FSDP helper without torchbay-fsdp."""
    seen = _python("""
    import json, torchbay.utils
    said = {}
    for name in ("TERecipeKwargs", "fsdp2_prepare_model"):
        try:
            getattr(torchbay.utils, name)
            said[name] = None
        except AttributeError as exc:
            said[name] = str(exc)
    print(json.dumps(said))
    """, switch=False, TORCHBAY_BLOCK_PLUGINS="fp8,fsdp")
    assert "pip install torchbay-fp8" in seen["TERecipeKwargs"]
    assert "pip install torchbay-fsdp" in seen["fsdp2_prepare_model"]


def test_the_plugin_hints_cover_every_accelerate_name_the_in_tree_plugins_answer():
    import configparser
    import glob

    hints = yaml.safe_load(open(os.path.join(ROOT, "core", "torchbay", "compat", "resources", "library_names.yaml"),
                                encoding="utf-8"))["plugin_hints"]
    answered: dict[str, set] = {}
    for fragment in glob.glob(os.path.join(ROOT, "plugins", "**", "accelerate.yaml"), recursive=True):
        api = (yaml.safe_load(open(fragment, encoding="utf-8")) or {}).get("api") or {}
        names = set(api.get("plugin_names", {})) | {n for group in api.get("unsupported", []) for n in group["names"]}
        if names:
            setup = configparser.ConfigParser()
            setup.read(os.path.join(fragment.split(os.sep + "torchbay_")[0], "setup.cfg"))
            answered.setdefault(setup["metadata"]["name"], set()).update(names)
    assert {k: set(v) for k, v in hints.items()} == answered


def test_patching_an_accelerate_function_patches_the_torchbay_function_that_answers_for_it():
    """transformers' skip_device_map_check sets accelerate.big_modeling.check_device_map for a while."""
    seen = _python("""
    import json, accelerate.big_modeling, torchbay.big_modeling.modeling
    original = torchbay.big_modeling.modeling.check_device_map
    accelerate.big_modeling.check_device_map = lambda *a, **k: "patched"
    patched = torchbay.big_modeling.modeling.check_device_map() == "patched"
    accelerate.big_modeling.check_device_map = original
    restored = torchbay.big_modeling.modeling.check_device_map is original
    print(json.dumps({"patched": patched, "restored": restored}))
    """, switch=True)
    assert seen == {"patched": True, "restored": True}


def test_mock_patch_of_an_accelerate_name_puts_the_torchbay_function_back():
    """unittest.mock.patch ends by deleting what it set on a module whose own namespace lacked the name (a stand-in's
    names live in the torchbay module): the torchbay function must come back, not be deleted (Accelerate's
    test_cli patches accelerate.commands.to_fsdp2.load_config, which later tests call)."""
    seen = _python("""
    import json
    from unittest.mock import patch
    import accelerate.commands.to_fsdp2 as served
    import torchbay_fsdp.to_fsdp2 as plugin
    original = plugin.load_config
    with patch("accelerate.commands.to_fsdp2.load_config", return_value={"fsdp_config": {}}):
        patched = plugin.load_config("x") == {"fsdp_config": {}}
    print(json.dumps({"patched": patched, "restored": plugin.load_config is original,
                      "served": served.load_config is original}))
    """, switch=True)
    assert seen == {"patched": True, "restored": True, "served": True}


def test_a_plugin_commands_accelerate_module_is_the_plugins_or_placeholders_naming_it():
    code = """
    import json
    import accelerate.commands.tpu as tpu
    from accelerate.commands.tpu import tpu_command_parser
    try:
        tpu_command_parser()
        said = None
    except Exception as exc:
        said = str(exc)
    print(json.dumps({"module": repr(tpu), "said": said}))
    """
    served = _python(code, switch=True)
    assert "torchbay_xla.tpu_config" in served["module"] and served["said"] is None
    unserved = _python(code, switch=True, TORCHBAY_BLOCK_PLUGINS="xla")
    assert "pip install torchbay-xla" in unserved["said"], unserved


def test_accelerates_file_name_constants_are_served_with_accelerates_values():
    import accelerate.utils.constants as real

    import torchbay.utils

    names = [n for n in yaml.safe_load(open(os.path.join(ROOT, "core", "torchbay", "compat", "resources",
                                                         "library_names.yaml"), encoding="utf-8"))["values"]
             if n.endswith("_NAME")]
    assert len(names) == 14
    assert {n: getattr(torchbay.utils, n) for n in names} == {n: getattr(real, n) for n in names}


TRACKER_LAYOUT = """
    import json, os, sys, tempfile
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    try:
        Accelerator(log_with="tensorboard")
        error = None
    except ValueError as exc:
        error = str(exc)
    AcceleratorState._reset_state(True)
    with tempfile.TemporaryDirectory() as project:
        accelerator = Accelerator(log_with="tensorboard", project_dir=project)
        accelerator.init_trackers("run1")
        accelerator.log({"loss": 0.5}, step=0)
        accelerator.end_training()
        dirs = sorted(os.path.relpath(root, project) for root, _, files in os.walk(project) if files)
    print(json.dumps({"error": error, "dirs": dirs}))
"""


def test_under_the_switch_trackers_write_where_accelerates_do():
    pytest.importorskip("tensorboard", reason="the tensorboard library writes the events")
    ours, theirs = _python(TRACKER_LAYOUT, switch=True), _python(TRACKER_LAYOUT, switch=False)
    assert ours["dirs"] == theirs["dirs"] == ["run1"]  # <project_dir>/<run>, not torchbay's logs/tensorboard/<run>
    assert "Logging with `tensorboard` requires a `logging_dir`" in theirs["error"]
    assert "Logging with `tensorboard` requires a `logging_dir`" in ours["error"]
