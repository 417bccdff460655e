"""``make compat-hf``: the Hugging Face libraries on Accelerate and on torchbay, side by side.

Runs in the venv that ``make compat-hf`` builds (.venv-hf: transformers, peft, trl, diffusers, datasets pinned by
tests/compat_hf/constraints-hf.txt, the real Accelerate, and torchbay with its plugins):

1. every case in :data:`CASES` (scripts under cases/, unchanged between the two runs) once on Accelerate and once on
   torchbay with the switch alone (``TORCHBAY_AS_ACCELERATE=1`` for one process, ``torchbay launch --as-accelerate``
   for several); their losses and metrics are compared (equal to 1e-6 in fp32, to bf16 rounding in bf16);
2. the names those libraries import from accelerate (accelerate_names.yaml) resolve on torchbay;
3. a selection of peft's own test suite, from its published source archive (fetched with pip, never copied here),
   once on each, with both counts and every test whose outcome differs.

Prints one table per part; exits 1 when anything differs. ``--only CASE`` runs the named cases and part 1 alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
CASE_TIMEOUT_S = 600
#: what was printed, for --results (the tables docs/accelerate-compat.md shows)
REPORT: list[str] = []


def say(*parts, **kwargs) -> None:
    text = " ".join(str(p) for p in parts)
    REPORT.append(text)
    print(text, flush=True)


@dataclasses.dataclass
class Case:
    name: str
    script: str
    args: tuple[str, ...] = ()
    processes: int = 1
    bf16: bool = False
    extra_env: tuple[tuple[str, str], ...] = ()
    launches_itself: bool = False  # the library's own CLI starts the processes (its launch flags are in args)
    #: a difference from Accelerate known and still to fix (issue and cause): reported in the table, not a failure
    known_difference: str = ""


DS_ZERO2, DS_ZERO3 = (str(HERE / "cases" / f"ds_zero{stage}.json") for stage in (2, 3))
#: what DeepSpeed needs to start one process without a launcher (it looks for MPI otherwise)
DEEPSPEED_ONE_PROCESS = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                         ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29513"))

CASES = [
    Case("Trainer: train, evaluate, predict (66 samples, batch 8)", "trainer_causal_lm.py"),
    Case("Trainer: train, evaluate, predict (66 samples, batch 8)", "trainer_causal_lm.py", processes=2),
    Case("Trainer: streaming (iterable) datasets, train, evaluate with an uneven last batch, predict",
         "trainer_causal_lm.py", ("--streaming",)),
    Case("Trainer: streaming (iterable) datasets, train, evaluate with an uneven last batch, predict",
         "trainer_causal_lm.py", ("--streaming",), processes=2),
    Case("Trainer: auto_find_batch_size retries after an out-of-memory step", "trainer_causal_lm.py",
         ("--auto-batch",)),
    Case("Trainer: grad accumulation 2, bf16, save, resume_from_checkpoint", "trainer_causal_lm.py",
         ("--grad-accum", "2", "--bf16", "--resume"), bf16=True),
    Case("Trainer: save_steps, resume_from_checkpoint", "trainer_causal_lm.py", ("--resume",), processes=2),
    Case("Trainer: eval each 4 steps, load_best_model_at_end, report_to tensorboard", "trainer_causal_lm.py",
         ("--best",), processes=2),
    # Accelerate 1.15 runs an FSDP plugin on GPUs only: with use_cpu its Trainer runs DDP (MULTI_CPU) and saves
    # optimizer.pt; torchbay runs FSDP2 (fully_shard over gloo) and saves Accelerate's FSDP files
    # (pytorch_model_fsdp.bin, optimizer.bin) through save_fsdp_model/save_fsdp_optimizer: same losses
    Case("Trainer: fsdp full_shard (FSDP2), train, evaluate, predict", "trainer_causal_lm.py", ("--fsdp",),
         processes=2),
    Case("Trainer: fsdp full_shard (FSDP2), save_steps, resume_from_checkpoint", "trainer_causal_lm.py",
         ("--fsdp", "--resume"), processes=2),
    Case("Trainer: fsdp SHARDED_STATE_DICT (DCP), save_steps, resume_from_checkpoint", "trainer_causal_lm.py",
         ("--fsdp", "--fsdp-sharded", "--resume"), processes=2),
    # DeepSpeed on its CPU accelerator: Accelerate 1.15 forms a several-process DeepSpeed group on a CPU machine only
    # with use_cpu (without, its state counts one process and Trainer's train_batch_size disagrees with DeepSpeed's);
    # one process needs torchrun's variables there (else DeepSpeed looks for MPI), given to both sides
    Case("Trainer: DeepSpeed ZeRO-2 JSON with auto values, train, evaluate, predict", "trainer_causal_lm.py",
         ("--deepspeed", DS_ZERO2), extra_env=DEEPSPEED_ONE_PROCESS),
    Case("Trainer: DeepSpeed ZeRO-3 JSON with auto values, train, evaluate, predict", "trainer_causal_lm.py",
         ("--deepspeed", DS_ZERO3), extra_env=DEEPSPEED_ONE_PROCESS),
    Case("Trainer: DeepSpeed ZeRO-2 JSON with auto values, train, evaluate, predict", "trainer_causal_lm.py",
         ("--deepspeed", DS_ZERO2), processes=2),
    Case("Trainer: DeepSpeed ZeRO-3 JSON with auto values, train, evaluate, predict", "trainer_causal_lm.py",
         ("--deepspeed", DS_ZERO3), processes=2),
    Case("Trainer: DeepSpeed ZeRO-3, save_steps, resume_from_checkpoint (the engine's own checkpoint)",
         "trainer_causal_lm.py", ("--deepspeed", DS_ZERO3, "--resume"), processes=2),
    Case("Trainer: DeepSpeed ZeRO-2 bf16 (the JSON's bf16.enabled \"auto\" from TrainingArguments(bf16=True))",
         "trainer_causal_lm.py", ("--deepspeed", DS_ZERO2, "--bf16"), bf16=True, extra_env=DEEPSPEED_ONE_PROCESS),
    Case("Trainer under `accelerate launch --use_deepspeed` (TrainingArguments makes DeepSpeedPlugin(), no JSON)",
         "trainer_causal_lm.py", processes=2, extra_env=(("ACCELERATE_USE_DEEPSPEED", "true"),)),
    Case("Trainer: DeepSpeed ZeRO-2 JSON without optimizer/scheduler (Trainer's AdamW and schedule), resume",
         "trainer_causal_lm.py", ("--deepspeed", str(HERE / "cases" / "ds_zero2_trainer_optim.json"), "--resume"),
         extra_env=DEEPSPEED_ONE_PROCESS),
    Case("peft: LoRA through Trainer, adapter saved and reloaded", "peft_lora.py"),
    Case("peft: LoRA through Trainer, adapter saved and reloaded", "peft_lora.py", processes=2),
    Case("trl: SFTTrainer", "trl_trainers.py", ("sft",)),
    Case("trl: SFTTrainer", "trl_trainers.py", ("sft",), processes=2),
    Case("trl: DPOTrainer", "trl_trainers.py", ("dpo",)),
    Case("trl CLI: `trl sft` (its accelerate launch)", "trl_cli.py", launches_itself=True),
    Case("trl CLI: `trl sft` (its accelerate launch)", "trl_cli.py", ("--multi_gpu", "--num_processes", "2"),
         processes=2, launches_itself=True),
    Case("diffusers: unconditional UNet2D loop, EMA, save/load_state, pipeline", "diffusers_unconditional.py"),
    # (Accelerate's own Accelerator() starts a multi-process CPU run only with ACCELERATE_USE_CPU, as
    # `accelerate launch --cpu` sets it; without it each rank trains alone. torchbay reads no ACCELERATE_* variable.)
    Case("diffusers: unconditional UNet2D loop, EMA, save/load_state, pipeline", "diffusers_unconditional.py",
         processes=2, extra_env=(("ACCELERATE_USE_CPU", "true"),)),
]


def _env(on_torchbay: bool, case: Case) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "ACCELERATE_"))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.update(dict(case.extra_env))
    if on_torchbay:
        env["TORCHBAY_AS_ACCELERATE"] = "1"
    return env


def _command(on_torchbay: bool, case: Case, out_dir: Path, result: Path) -> list[str]:
    script = [str(HERE / "cases" / case.script), str(out_dir), str(result), *case.args] \
        if case.script != "trl_trainers.py" else \
        [str(HERE / "cases" / case.script), case.args[0], str(out_dir), str(result), *case.args[1:]]
    if case.processes == 1 or case.launches_itself:
        return [sys.executable, *script]
    if on_torchbay:
        return [str(BIN / "torchbay"), "launch", "-q", "--as-accelerate", "--num-processes", str(case.processes),
                *script]
    return [str(BIN / "torchrun"), "--nproc_per_node", str(case.processes), "--master_port", str(_free_port()),
            *script]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_case(case: Case, on_torchbay: bool, work: Path) -> tuple[dict | None, str, float]:
    side = "torchbay" if on_torchbay else "accelerate"
    out_dir = work / side
    result = work / f"{side}.json"
    started = time.monotonic()
    try:
        done = subprocess.run(_command(on_torchbay, case, out_dir, result), env=_env(on_torchbay, case),
                              capture_output=True, text=True, timeout=CASE_TIMEOUT_S, cwd=work)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {CASE_TIMEOUT_S} s", time.monotonic() - started
    seconds = time.monotonic() - started
    if done.returncode != 0 or not result.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        return None, f"exit {done.returncode}:\n{tail}", seconds
    return json.loads(result.read_text()), "", seconds


def compare(expected: dict, got: dict, bf16: bool) -> tuple[float, list[str]]:
    """Largest difference between two results and the fields that disagree beyond the tolerance."""
    worst, problems = 0.0, []
    for key, want in expected.items():
        if key == "served_by":
            continue
        have = got.get(key)
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            want, have = [want], [have] if have is not None else None
        if isinstance(want, list) and want and all(isinstance(x, (int, float)) for x in want):
            if not isinstance(have, list) or len(have) != len(want):
                problems.append(f"{key}: {len(want)} values on Accelerate, {have!r} on torchbay")
                continue
            diffs = [abs(a - b) / (max(abs(a), 1.0) if bf16 else 1.0) for a, b in zip(want, have)]
            worst = max(worst, *diffs)
            if max(diffs) > (2e-2 if bf16 else 1e-6 + 1e-9):  # fp32: one unit of the 6th decimal the cases round to
                problems.append(f"{key}: {want} on Accelerate, {have} on torchbay")
        elif want != have:
            problems.append(f"{key}: {want!r} on Accelerate, {have!r} on torchbay")
    if got.get("served_by") != "torchbay":
        problems.append("the torchbay run did not import torchbay as accelerate")
    return worst, problems


def part_cases(selected: list[Case], work_root: Path) -> list[str]:
    say("\n## The training cases, on Accelerate and on torchbay\n")
    say("| case | processes | Accelerate | torchbay | largest difference | result |")
    say("|---|---|---|---|---|---|")
    failures = []
    for number, case in enumerate(selected):
        work = work_root / f"case{number}"
        work.mkdir(parents=True)
        expected, error_a, seconds_a = run_case(case, False, work)
        retried = ""
        if expected is None:
            # Accelerate is the reference here, not what is judged: it leaves its process group alive at exit,
            # and gloo then aborts a rank now and then (SIGABRT after a finished run, seen in CI). One more try
            # of the reference, said in the table; the torchbay run gets no second try.
            retried = f" (Accelerate run failed once and passed on a second try: {error_a.splitlines()[0]})"
            shutil.rmtree(work / "accelerate", ignore_errors=True)  # both in this case's own temporary folder
            (work / "accelerate.json").unlink(missing_ok=True)
            expected, error_a, seconds_a = run_case(case, False, work)
        got, error_t, seconds_t = run_case(case, True, work)
        if expected is None:
            verdict, worst = f"Accelerate run failed: {error_a.splitlines()[0]}", None
            failures.append(f"{case.name} x{case.processes} on Accelerate: {error_a}")
        elif got is None:
            verdict, worst = f"torchbay run failed: {error_t.splitlines()[0]}", None
            failures.append(f"{case.name} x{case.processes} on torchbay: {error_t}")
        else:
            worst, problems = compare(expected, got, case.bf16)
            verdict = ("same" if not problems else "DIFFERS") + retried
            failures.extend(f"{case.name} x{case.processes}: {p}" for p in problems)
        if case.known_difference and expected is not None and (got is None or verdict.startswith("DIFFERS")):
            failures = [f for f in failures if not f.startswith(f"{case.name} x{case.processes}")]
            verdict = f"known difference, still to fix ({case.known_difference}): {verdict}"
        shown = "-" if worst is None else f"{worst:.1e}"
        say(f"| {case.name} | {case.processes} | {seconds_a:.0f} s | {seconds_t:.0f} s | {shown} | {verdict} |",
              flush=True)
    return failures


def part_names() -> list[str]:
    say("\n## Names the libraries import from accelerate\n")
    done = subprocess.run([sys.executable, str(HERE / "scan_accelerate_names.py"), "--resolve"],
                          env=_env(True, Case("", "")), capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return [f"the name check failed: {done.stderr.strip()[-2000:]}"]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    count, bad = sum(report["count"].values()), report["missing"]
    say(f"{count - len(bad)} of {count} names resolve on torchbay")
    for line in bad:
        say(f"- {line}")
    return bad


#: peft's own tests that need no hub download and exercise what torchbay serves (run from its sdist): its custom-model
#: suite's device_map tests (every tuner on MLP/conv/embedding models, dispatched with accelerate's big-model layer).
#: Its other suites load tiny models from the Hugging Face hub, which CI cannot reach.
PEFT_TESTS = ["tests/test_custom_models.py", "-k", "device_map"]


def _outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` from a pytest JUnit XML report."""
    import xml.etree.ElementTree as ElementTree

    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def part_library_tests(work_root: Path) -> list[str]:
    import importlib.metadata

    version = importlib.metadata.version("peft")
    say(f"\n## peft {version}'s own tests (from its source archive), on Accelerate and on torchbay\n")
    archive_dir = work_root / "sdist"
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              f"peft=={version}", "-d", str(archive_dir)], capture_output=True, text=True)
    if fetched.returncode != 0:
        return [f"could not fetch peft's source archive: {fetched.stderr.strip()[-500:]}"]
    shutil.unpack_archive(str(next(archive_dir.glob("peft-*.tar.gz"))), str(archive_dir))
    source = next(p for p in archive_dir.iterdir() if p.is_dir())
    (source / "tests" / "__init__.py").touch()  # the archive leaves it out; its tests import each other relatively
    results = {}
    for side, on_torchbay in (("Accelerate", False), ("torchbay", True)):
        report = work_root / f"peft-{side}.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        f"--junitxml={report}", *PEFT_TESTS], env=_env(on_torchbay, Case("", "")), cwd=source,
                       capture_output=True, text=True, timeout=1800)
        results[side] = _outcomes(report)
    counts = {side: {k: sum(1 for o in r.values() if o == k) for k in ("passed", "failed", "skipped")}
              for side, r in results.items()}
    say("| | passed | failed | skipped |\n|---|---|---|---|")
    for side, c in counts.items():
        say(f"| {side} | {c['passed']} | {c['failed']} | {c['skipped']} |")
    differ = sorted(n for n in set(results["Accelerate"]) | set(results["torchbay"])
                    if results["Accelerate"].get(n) != results["torchbay"].get(n))
    for name in differ:
        say(f"- {name}: {results['Accelerate'].get(name)} on Accelerate, {results['torchbay'].get(name)} on torchbay")
    if not differ:
        say("\nEvery test has the same outcome on both.")
    return [f"peft test {n} differs" for n in differ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="run only cases whose name contains this")
    parser.add_argument("--skip-library-tests", action="store_true")
    parser.add_argument("--results", metavar="FILE", help="also write the tables here (docs/compat-hf-results.md)")
    args = parser.parse_args(argv)
    import importlib.metadata

    versions = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in
                         ("torch", "accelerate", "transformers", "peft", "trl", "diffusers", "datasets", "torchbay"))
    say(f"Measured by `make compat-hf` ({versions}), on a 2-core CPU machine.")
    selected = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    with tempfile.TemporaryDirectory(prefix="compat-hf-") as tmp:
        work = Path(tmp)
        failures = part_cases(selected, work)
        if not args.only:
            failures += part_names()
            if not args.skip_library_tests:
                failures += part_library_tests(work)
    if failures:
        say("\n## Differences\n")
        for failure in failures:
            say(f"- {failure}")
    else:
        say("\nAll the same.")
    if args.results:
        Path(args.results).write_text("\n".join(REPORT).replace("\n## ", "\n### ") + "\n", encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
