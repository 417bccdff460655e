"""What the compatibility suite runs: Accelerate 1.15's own test scripts, function by function.

Each script lists its cases in the order its ``main()`` runs them. A case is Python code run
in the script's namespace after ``setup`` (what ``main()`` does first); ``procs`` are the
process counts it runs with. ``SKIPS`` says, for a case and a process count, why it does not
run: each reason is something Accelerate itself cannot pass on a CPU-only machine with the
dev dependencies, or a check that ``main()`` only makes elsewhere. Nothing is dropped
silently: skipped cases appear in the table with their reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BOTH = (1, 2)


@dataclass
class Script:
    path: str  # under accelerate/test_utils/scripts
    setup: str
    cases: list[tuple[str, str]]  # (name, code)
    procs: tuple[int, ...] = BOTH
    launched: bool = True  # False: run with python, NUM_PROCESSES from the environment
    main_procs: tuple[int, ...] = BOTH
    #: third-party modules the script imports only for cases skipped here; inert stand-ins
    #: are put in their place when they are not installed
    stand_ins: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def _calls(*names: str, arg: str = "") -> list[tuple[str, str]]:
    return [(name, f"{name}({arg})") for name in names]


def _grad_acc(fn: str, combos) -> list[tuple[str, str]]:
    out = []
    for split, dispatch, each in combos:
        args = f"split_batches={split}, dispatch_batches={dispatch}, sync_each_batch={each}"
        out.append((f"{fn}({args})", f"{fn}({args})"))
    return out


_COMBOS = [(s, d, e) for s in (True, False) for d in (True, False) for e in (True, False)]

SCRIPTS: dict[str, Script] = {
    "test_ops": Script(
        "test_ops.py", "state = PartialState()",
        _calls("test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
               "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean", "test_reduce_max",
               "test_op_checker", "test_copy_tensor_to_devices", arg="state")),
    "test_script": Script(
        "test_script.py", "accelerator = Accelerator(); state = accelerator.state",
        _calls("init_state_check", "process_execution_check", "test_split_between_processes_list",
               "test_split_between_processes_nested_dict", "test_split_between_processes_tensor",
               "test_split_between_processes_evenly")
        + [("test_split_between_processes_dataset",
            "from datasets import Dataset as _D; test_split_between_processes_dataset(_D)")]
        + _calls("rng_sync_check", "dl_preparation_check", "central_dl_preparation_check", "custom_sampler_check",
                 "check_seedable_sampler", "check_seedable_sampler_with_data_seed",
                 "check_seedable_sampler_in_batch_sampler_shard")
        + [("training_check(use_seedable_sampler=False)", "training_check(use_seedable_sampler=False)"),
           ("training_check(use_seedable_sampler=True)", "training_check(use_seedable_sampler=True)")]
        + _calls("test_trigger", "test_reinstantiated_state")),
    "test_sync": Script(
        "test_sync.py", "accelerator = Accelerator(); state = accelerator.state",
        _calls("test_dataloader_break")
        + _calls("test_noop_sync", "test_distributed_sync", "test_distributed_sync_multiple_fwd", arg="accelerator")
        + _grad_acc("test_gradient_accumulation", _COMBOS)
        + _grad_acc("test_gradient_accumulation_with_opt_and_scheduler", _COMBOS)),
    "test_distributed_data_loop": Script(
        "test_distributed_data_loop.py",
        "accelerator = create_accelerator(); torch.manual_seed(accelerator.process_index); dataset = DummyDataset()",
        _calls("test_default_ensures_even_batch_sizes", "test_can_disable_even_batches", "test_can_join_uneven_inputs",
               "test_join_can_override_even_batches", "test_join_can_override_for_mixed_type_dataloaders",
               "test_join_raises_warning_for_iterable_when_overriding_even_batches")
        + [("test_join_raises_warning_for_non_ddp_distributed",
            "_orig = accelerator.state.distributed_type\n"
            "accelerator.state.distributed_type = DistributedType.FSDP\n"
            "try:\n    test_join_raises_warning_for_non_ddp_distributed(accelerator)\n"
            "finally:\n    accelerator.state.distributed_type = _orig")]
        + _calls("test_pickle_accelerator")
        + [("test_data_loader(shuffle=False)",
            "test_data_loader(DataLoader(dataset, shuffle=False, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS), "
            "accelerator)"),
           ("test_data_loader(shuffle=True)",
            "test_data_loader(DataLoader(dataset, shuffle=True, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS), "
            "accelerator)"),
           ("test_data_loader(batch_sampler)",
            "test_data_loader(DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), "
            "batch_size=BATCH_SIZE, drop_last=False), num_workers=NUM_WORKERS), accelerator)"),
           ("test_data_loader(sampler=BatchSampler)",
            "test_data_loader(DataLoader(dataset, sampler=BatchSampler(RandomSampler(dataset), batch_size=BATCH_SIZE, "
            "drop_last=False), batch_size=None, collate_fn=default_collate, num_workers=NUM_WORKERS), accelerator)")]
        + _calls("test_stateful_dataloader", "test_stateful_dataloader_save_state", arg="accelerator"),
        procs=(2,), main_procs=(2,)),
    "test_metrics": Script(
        "external_deps/test_metrics.py", "accelerator = Accelerator()",
        [("test_torch_metrics(split_batches=%s, dispatch_batches=%s)" % (s, d),
          "test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=%s, "
          "dispatch_batches=%s)), 99)" % (s, d)) for s in (True, False) for d in (True, False)]
        + [("test_torch_metrics(512)", "test_torch_metrics(Accelerator(), 512)")]
        + _calls("test_gather_for_metrics_drop_last", "test_gather_for_metrics_with_iterable_dataset",
                 "test_gather_for_metrics_with_non_tensor_objects_iterable_dataset")
        + [("test_mrpc", "test_mrpc()")],
        stand_ins=("datasets", "evaluate", "transformers")),
    "test_notebook": Script(
        "test_notebook.py", "",
        _calls("test_can_initialize", "test_clean_cuda_fork", "test_static_rdzv_backend", "test_c10d_rdzv_backend",
               "test_fault_tolerant", "test_monitoring", "test_problematic_imports"),
        launched=False,
        # test_fault_tolerant races on its own queue: a rank that saw the queue non-empty can block in
        # queue.get() for good while its peer took the last item and waits for it in the process group's
        # set-up (a hang for 10 min, the default timeout, on Accelerate too). A short timeout turns that into
        # a failed attempt, and the launcher's next restart finds the queue empty and passes, as the test means.
        env={"TORCHBAY_PROCESS_GROUP_TIMEOUT_S": "30"}),
    "test_ddp_comm_hook": Script(
        "test_ddp_comm_hook.py", "",
        [(f"test_ddp_comm_hook({hook}, {wrapper}{', ' + state if state else ''})",
          f"test_ddp_comm_hook(DDPCommunicationHookType.{hook}, DDPCommunicationHookType.{wrapper}, "
          f"{{{state}}})") for hook, wrapper, state in [
            ("NO", "NO", ""), ("FP16", "NO", ""), ("BF16", "NO", ""), ("POWER_SGD", "NO", ""),
            ("POWER_SGD", "FP16", ""), ("POWER_SGD", "BF16", ""),
            ("POWER_SGD", "NO", "'matrix_approximation_rank': 2"), ("BATCHED_POWER_SGD", "NO", ""),
            ("BATCHED_POWER_SGD", "FP16", ""), ("BATCHED_POWER_SGD", "BF16", "")]]),
    "test_cli": Script("test_cli.py", "", [], procs=(), main_procs=(1,)),
    "test_merge_weights": Script("test_merge_weights.py", "", [], procs=(), main_procs=(2,)),
    # the external_deps scripts other than test_metrics: each listed, none runnable here (see SKIPS)
    **{name: Script(f"external_deps/{name}.py", "", [], procs=(), main_procs=(2,))
       for name in ("test_checkpointing", "test_ds_alst_ulysses_sp", "test_ds_multiple_model",
                    "test_peak_memory_usage", "test_performance", "test_pippy", "test_zero3_integration")},
}

_ONE_PROCESS_ONLY = "main() runs it only in one process: it checks that no_sync does nothing, true only there"
_SEVERAL_ONLY = "main() runs it only with several processes; in one, local and global gradients are the same"
_COMM_HOOK = ("the script's reference model is DistributedDataParallel(device_ids=[rank]), which torch refuses "
              "for a CPU module (Accelerate fails the same way); torchbay's comm hooks are checked in "
              "tests/compat_api/test_accelerate_compat.py")

#: (script, case or "main()", processes) -> reason (None for processes: every count). Each one is
#: something Accelerate 1.15 itself does not pass on a CPU-only machine with the dev dependencies
#: (measured with ``run.py --accelerate``), or a check its main() makes only elsewhere.
SKIPS: dict[tuple[str, str, int | None], str] = {
    ("test_script", "test_split_between_processes_dataset", None):
        "needs Hugging Face datasets, not a dev dependency (split_between_processes of a datasets.Dataset is "
        "covered by tests/compat_api/test_accelerate_compat.py with a stand-in having select())",
    ("test_script", "check_seedable_sampler_in_batch_sampler_shard", 1): "asserts several processes (main() runs it "
                                                                          "only then)",
    ("test_sync", "test_noop_sync", 2): _ONE_PROCESS_ONLY,
    ("test_sync", "test_distributed_sync", 1): "main() runs it only with several processes (no_sync does nothing "
                                               "in one)",
    **{("test_sync", f"test_gradient_accumulation(split_batches={s}, dispatch_batches={d}, sync_each_batch=False)", 1):
       _SEVERAL_ONLY for s in (True, False) for d in (True, False)},
    ("test_metrics", "test_mrpc", None): "downloads GLUE/MRPC and a BERT checkpoint from the Hugging Face Hub "
                                         "(no network here; main() runs it only on GPUs)",
    ("test_notebook", "test_fault_tolerant", 1): "marked require_multi_process (with one process the function "
                                                 "runs in place and its deliberate error is not retried)",
    ("test_notebook", "test_monitoring", 1): "marked require_multi_process",
    ("test_notebook", "test_problematic_imports", None): "needs bitsandbytes (require_bnb)",
    ("test_notebook", "main()", 1): "main() calls the require_multi_process functions too, which Accelerate "
                                    "fails with one process (the deliberate errors are not retried)",
    ("test_merge_weights", "main()", None):
        "Accelerate fails it on CPU (FSDP1's state_dict_type is left None: KeyError in torch's set_state_dict_type); "
        "it also drives accelerate.commands.merge, Accelerate's CLI, which torchbay replaces with `torchbay "
        "merge-weights` (plugins/fsdp/tests/test_fsdp.py) and merge_fsdp_weights",
    **{(name, "main()", None): "needs transformers and datasets and downloads models or datasets from the Hugging "
                               "Face Hub (no network here); Accelerate runs it on GPUs only"
       for name in ("test_checkpointing", "test_ds_alst_ulysses_sp", "test_ds_multiple_model", "test_peak_memory_usage",
                    "test_performance", "test_pippy", "test_zero3_integration")},
    **{("test_ddp_comm_hook", case, None): _COMM_HOOK
       for case in [c for c, _ in SCRIPTS["test_ddp_comm_hook"].cases] + ["main()"]},
}


def skip_reason(script: str, case: str, procs: int) -> str | None:
    return SKIPS.get((script, case, procs)) or SKIPS.get((script, case, None))

#: (script, case, processes) -> why it fails on torchbay today; empty when everything passes
EXPECTED_FAILURES: dict[tuple[str, str, int], str] = {}
