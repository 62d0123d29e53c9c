"""Does the suite still catch what it caught? Each mutation is a one-place break of the code that
a named test once caught (recorded in the project's history) or was written to catch; this script
applies each to a scratch copy of the checkout and runs its tests there, which must fail.

    .venv/bin/python tests/mutations.py               # every mutation
    .venv/bin/python tests/mutations.py NAME ...      # those named
    .venv/bin/python tests/mutations.py --list

Not a test module (pytest collects test_*.py only): each mutation runs its tests for seconds to
minutes. A copy's own src/ comes first on PYTHONPATH, ahead of the editable install, so the
tests, the Snakemake runs they start and their ranks all import the mutated package. A test that
needs the throw-away Slurm cluster (tests/slurm/up.sh) or root is skipped where it cannot run,
and the mutation is then reported as not run, never as caught."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str = ""
    env: dict = field(default_factory=dict)


MUTATIONS = [
    # --- recorded in the project's history (commit bodies and docs: "fails without the fix") ---
    Mutation('login-node-caps-node-cpus', 'src/imgclf/slurm/jobs.py',
             '{"cpus_per_task": cpus, ',
             '{"cpus_per_task": None, ',
             ('tests/test_slurm_shapes.py::test_jobs_that_take_a_node_ask_for_its_cpus_from_a_smaller_login_node',),
             "without cpus_per_task the plugin takes the rule's threads, which the submitting Snakemake caps at a 2-core login node (p4's hydration check asked for 2 CPUs, not 96)"),
    Mutation('loader-pins-on-an-unclaimed-gpu', 'src/imgclf/loader_bench/__init__.py',
             '    device = devices.claim_device(hw, "32", f"The loader benchmark of cluster {hw[\'name\']!r}")\n    return device is not None',
             '    return torch.cuda.is_available()',
             ('tests/test_hardware.py::test_the_loader_benchmark_pins_on_a_gpu_of_its_entry_it_claimed',),
             'the loader benchmark pinned memory on whatever GPU 0 was, without claiming a GPU of its entry first'),
    Mutation('node-job-without-node-memory', 'src/imgclf/slurm/jobs.py',
             '"mem_mb_per_cpu": memory_mb_per_cpu(cluster, cpus)}',
             '"mem_mb_per_cpu": None}',
             ('tests/test_slurm_shapes.py::test_jobs_that_take_a_node_ask_for_its_cpus_from_a_smaller_login_node',),
             "a job of all 96 CPUs of a p4 node fell back to the profile's 4 GB (--mem) instead of its share of 90 % of the node's RAM (--mem-per-cpu)"),
    Mutation('verification-names-an-untried-batch', 'src/imgclf/memory/measure.py',
             'if batch <= smallest or attempt == max_backoffs:',
             'if batch <= smallest:',
             ('tests/test_memory.py::test_a_verification_out_of_tries_names_the_batch_it_tried',),
             'out of back-offs, _verify returned the next smaller batch it never ran and the sentence named it (136 after 144 failed)'),
    Mutation('named-probe-below-smallest-batch', 'src/imgclf/memory/measure.py',
             'sorted({max(smallest, b) for b in probes})',
             'sorted(probes)',
             ('tests/test_memory.py::test_the_measured_solve_never_steps_below_the_smallest_trainable_batch',),
             'user-named probe batches below the smallest trainable batch ([1, 2, 4] at 32 px) ran a batch-norm step at batch 1'),
    Mutation('warm-up-at-batch-one', 'src/imgclf/memory/measure.py',
             '        step(smallest)\n',
             '        step(1)\n',
             ('tests/test_memory.py::test_the_measured_solve_never_steps_below_the_smallest_trainable_batch',),
             "the measured solve's warm-up at batch 1 stops at 32 px: batch norm refuses one value per channel (ResNet-18's 1x1 last map)"),
    Mutation('noise-scale-logged-unsynced', 'src/imgclf/train/callbacks.py',
             'on_epoch=True,\n                          sync_dist=True)',
             'on_epoch=True)',
             ('tests/test_pipeline.py::test_the_complete_runs_training_is_ddp_over_two_processes_through_the_cli',),
             "Lightning prints its sync_dist advice for an unsynced epoch metric in every DDP run's log"),
    Mutation('ctrl-c-read-as-a-dropped-download', 'run.sh',
             "trap 'exit 130' INT",
             ':',
             ('tests/test_hardware.py::test_ctrl_c_during_the_set_up_ends_it',),
             'pip exits 1 at Ctrl-C and the set-up tried the install again 60 s later instead of ending with 130'),
    Mutation('lock-digest-reads-inline-comments', 'src/imgclf/lock.py',
             '"ceiling": [line.split("#")[0].strip() for line in ceiling.read_text().splitlines()',
             '"ceiling": [line.strip() for line in ceiling.read_text().splitlines()',
             ('tests/test_hardware.py::test_the_lock_digest_follows_the_declared_dependencies_not_comments',),
             "a digest that took a requirement's inline comment into account passed the test before 30f90a6 tightened it"),
    Mutation('pyproject-changed-without-new-locks', 'pyproject.toml',
             '"lightning>=2.6",',
             '"lightning>=2.6.1",',
             ('tests/test_hardware.py::test_every_lock_holds_what_pyproject_declares_each_with_its_hashes',),
             'the recorded check: a test fails when pyproject.toml changed and the locks were not made again'),
    Mutation('ceiling-changed-without-new-locks', 'requirements/ceiling.txt',
             'torch<=2.14.1',
             'torch<=2.15',
             ('tests/test_hardware.py::test_every_lock_holds_what_pyproject_declares_each_with_its_hashes',),
             'the recorded check: a test fails when the ceiling changed and the locks were not made again'),
    Mutation('shared-build-failure-not-recorded', 'tests/conftest.py',
             'failed.write_text(f"{type(exc).__name__}: {exc}"[-3000:])',
             'pass',
             ('tests/test_foundation.py::test_a_shared_build_that_failed_fails_its_other_users_at_once',),
             'a shared build that failed was built again by each worker waiting for it (test infrastructure, tests/conftest.py)'),
    Mutation('forkserver-dies-of-the-requeue-signal', 'src/imgclf/data.py',
             '    with noted_signals_blocked():\n        multiprocessing.forkserver.ensure_running()',
             '    multiprocessing.forkserver.ensure_running()',
             ('tests/test_slurm.py::test_the_requeue_signal_leaves_a_ranks_fork_server_workers_loading',),
             "the fork server, its workers and the resource tracker start by exec with SIGUSR1's default action and died of Slurm's requeue signal"),
    Mutation('one-task-training-as-an-mpi-job', 'src/imgclf/slurm/jobs.py',
             '"mpi": launch if world > 1 else "",',
             '"mpi": launch,',
             ('tests/test_slurm.py::test_cpu_entry_asks_for_its_cpu_processes_and_one_gpu_takes_one_srun_task',),
             'the Slurm plugin refuses an MPI job of one task: `mpi` must be present but empty for one task'),
    Mutation('cpu-entry-asks-for-a-gpu', 'workflow/rules/resources.smk',
             '    return int(hw(wildcards)["accelerator"] != "cpu")',
             '    return 1',
             ('tests/test_slurm_shapes.py::test_every_job_asks_for_the_entrys_gpus_or_none',),
             "CPU entries' lr_find and noise_scale jobs asked Slurm for a GPU, which a CPU partition refuses"),
    Mutation('lock-file-under-the-users-umask', 'src/imgclf/devices.py',
             '            os.fchmod(fd, 0o666)\n',
             '',
             ('tests/test_hardware.py::test_the_lock_folder_and_its_files_are_writable_by_every_user_under_umask_022',
              'tests/test_hardware.py::test_a_second_user_under_umask_022_claims_gpus_beside_the_first'),
             'a lock file made under umask 022 is 0644, and a second user cannot open it for writing to wait for that GPU (the second test needs root: skipped otherwise)'),
    Mutation('unwritable-lock-is-a-traceback', 'src/imgclf/devices.py',
             '        except (FileNotFoundError, PermissionError) as e:',
             '        except FileNotFoundError as e:',
             ('tests/test_hardware.py::test_a_lock_file_another_user_left_read_only_is_one_sentence',),
             'a lock file another user left read-only must stop the claim in one sentence, not a PermissionError (needs root: skipped otherwise)'),
    Mutation('claim-ignores-the-entrys-gpu-model', 'src/imgclf/devices.py',
             'gpus = [g for g in visible if entry and hardware.is_entry_gpu(entry, g)] or visible',
             'gpus = visible',
             ('tests/test_hardware.py::test_a_node_of_mixed_gpus_runs_each_stage_on_its_entrys_gpu',),
             "on a node of mixed GPUs a claim took the first free GPU, not one of the entry's model"),
    Mutation('srun-ranks-get-torchs-default-timeout', 'src/imgclf/train/resume.py',
             'rank=env.global_rank(), timeout=timeout, **device)',
             'rank=env.global_rank(), **device)',
             ('tests/test_train.py::test_the_training_timeout_and_device_reach_both_process_groups', 'tests/test_train.py::test_ranks_srun_started_wait_for_their_peers_as_long_as_configured'),
             "srun's ranks made their process group with torch's default timeout, not train.collective_timeout_minutes"),
    Mutation('srun-ranks-without-device-id', 'src/imgclf/train/resume.py',
             '        device = {"device_id": torch.device("cuda", env.local_rank())}',
             '        device = {}',
             ('tests/test_train.py::test_the_training_timeout_and_device_reach_both_process_groups',),
             "under NCCL srun's ranks must bind their communicator to their GPU (device_id)"),
    Mutation('lightning-ranks-default-timeout', 'src/imgclf/train/trainer.py',
             'checkpoint_io=AtomicCheckpointIO(),\n                                             timeout=collective_timeout(t))}',
             'checkpoint_io=AtomicCheckpointIO())}',
             ('tests/test_train.py::test_trainer_options_follow_the_device',),
             'the ranks Lightning starts must get the configured collective timeout too (asserted in 1f0cc5e)'),
    Mutation('noise-partial-step-at-full-batch', 'src/imgclf/train/callbacks.py',
             '        batch = self.examples\n',
             '        batch = self.small_batch\n',
             ('tests/test_noise_scale.py::test_training_logs_the_noise_scale_of_the_steps_it_took',),
             "an epoch's partial accumulation step must be counted at the examples it had, not a full step's"),
    Mutation('noise-hook-keeps-one-bucket', 'src/imgclf/gradient_noise.py',
             'return torch.stack(parts).sum() if parts else',
             'return parts[-1] if parts else',
             ('tests/test_noise_scale.py::test_the_hook_takes_each_ranks_norm_and_the_all_reduced_one',),
             'per-bucket norms must all be summed at take() (the recorded race between CUDA streams cannot show on the CPU; this is the closest the CPU test catches)'),
    Mutation('loss-scale-read-on-the-host', 'src/imgclf/train/callbacks.py',
             '    scale = scaler._get_scale_async()',
             '    scale = torch.tensor(scaler.get_scale())',
             ('tests/test_noise_scale.py::test_training_logs_the_noise_scale_of_the_steps_it_took',),
             "the AMP loss scale must be read without a host synchronisation (the test's scaler fails on get_scale)"),
    Mutation('requeue-check-through-strategy-reduce', 'src/imgclf/train/callbacks.py',
             '            torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)',
             '            asked = trainer.strategy.reduce(asked, reduce_op="max")',
             ('tests/test_slurm.py::test_the_requeue_check_is_one_all_reduce_without_a_barrier',),
             "Lightning's strategy.reduce runs a barrier before its all-reduce; the check must be one all-reduce"),
    Mutation('lr-runs-time-without-autotuning', 'src/imgclf/one_device.py',
             '    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)',
             '    torch.backends.cudnn.benchmark = False',
             ('tests/test_lr.py::test_range_test_sees_the_recipes_mixed_batches',),
             "the LR runs must time their steps with training's cuDNN autotuning"),
    Mutation('forecast-silent-on-compile', 'src/imgclf/forecast.py',
             '    if not train.get("compile"):',
             '    if True:',
             ('tests/test_forecast.py::test_the_forecast_says_how_the_timed_steps_differ_from_training',),
             'a training that compiles must get a forecast that says its step times came from uncompiled runs'),
    Mutation('cudnn9-allocation-failure-not-backed-off', 'src/imgclf/memory/measure.py',
             '                       "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",\n',
             '',
             ('tests/test_memory.py::test_allocation_failures_of_other_libraries_back_off_too',),
             "cuDNN 9's allocation failure must back the memory search off like an out-of-memory"),
    Mutation('cublas-handle-failure-not-backed-off', 'src/imgclf/memory/measure.py',
             '"CUBLAS_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED",',
             '"CUBLAS_STATUS_ALLOC_FAILED",',
             ('tests/test_memory.py::test_allocation_failures_of_other_libraries_back_off_too',),
             'cuBLAS failing to create its handle under memory pressure must back the search off'),
    Mutation('cudnn-no-engine-not-backed-off', 'src/imgclf/memory/measure.py',
             '                       "was unable to find an engine to execute this computation",\n',
             '',
             ('tests/test_memory.py::test_allocation_failures_of_other_libraries_back_off_too',),
             'a convolution none of whose cuDNN plans could allocate its workspace must back the search off'),
    Mutation('nccl-peer-loss-taken-for-own-error', 'src/imgclf/train/failures.py',
             '        and any(marker in text for marker in NCCL_PEER_GONE))',
             '        and False)',
             ('tests/test_train.py::test_a_collective_that_failed_with_its_peer_is_told_apart',),
             "peer_failed must know NCCL's words for a peer that is gone, not only gloo's"),
    Mutation('eval-metrics-validate-every-batch', 'src/imgclf/evaluate.py',
             'check = {"validate_args": False}',
             'check = {"validate_args": True}',
             ('tests/test_evaluate.py::test_topk_on_a_fixed_example',),
             "evaluation's metrics must skip torchmetrics' per-batch argument checks (a device sync each)"),
    Mutation('torch-for-ignores-entry-names', 'src/imgclf/cuda_builds.py',
             '    model = models.get(target, target)',
             '    model = target',
             ('tests/test_hardware.py::test_an_environment_built_elsewhere_gets_the_build_its_hardware_needs',),
             'IMGCLF_TORCH_FOR=p3 (an entry) must choose the CUDA 12.6 build of its V100s'),
    Mutation('snakefile-runs-under-a-spaced-path', 'src/imgclf/stage.py',
             '    if shlex.quote(executable) != executable:',
             '    if False:',
             ('tests/test_foundation.py::test_a_checkout_under_a_path_with_a_space_is_refused_in_one_sentence',),
             "Snakemake runs scripts with the interpreter's path unquoted (snakemake#2645): the Snakefile must refuse a checkout under a path with a space"),
    Mutation('build-checked-before-the-claim', 'src/imgclf/devices.py',
             '    claim_gpus(count, what, entry)\n    if not hardware.cuda_ready(entry):\n        return None\n',
             '    if not hardware.cuda_ready(entry):\n        return None\n    claim_gpus(count, what, entry)\n',
             ('tests/test_hardware.py::test_each_gpu_stage_claims_its_gpu_before_it_checks_the_build',),
             'checked before the claim, CUDA starts seeing every GPU and every LR run on a node shares GPU 0'),
    Mutation('estimate-without-the-input-batch', 'src/imgclf/memory/estimate.py',
             '"batch": data.sample_batch_bytes(batch, resolution) + batch * 8,',
             '"batch": 0,',
             ('tests/test_memory.py::test_estimate_matches_the_fake_tensor_count',),
             'the tightened bound (1.5 % under, 0.5 % over) shows a component left out, such as the input batch (2 % of ResNet-18 at batch 16); the old 5 % did not'),
    Mutation('pure-noise-always-gives-a-value', 'src/imgclf/gradient_noise.py',
             '    return float(np.mean(trace)) / g if g > 0 else None',
             '    return float(np.mean(trace)) / abs(g) if g else None',
             ('tests/test_noise_scale.py::test_pure_noise_gives_no_noise_scale_or_a_huge_one_and_says_what_to_raise',),
             'with |G|^2 = 0 the estimate must sometimes be none (a mean that is not positive); the old test passed whatever came'),
    Mutation('cpu-rank-efficiency-applied-twice', 'src/imgclf/forecast.py',
             '"compute_s": measured["step_s_alone"],',
             '"compute_s": measured["step_s_together"],',
             ('tests/test_forecast.py::test_cpu_ranks_are_forecast_at_their_side_by_side_step',),
             'the efficiency must be applied once, to the step alone: 1.6 s a step, not 2.56 s'),
    Mutation('cpu-rank-efficiency-inverted', 'src/imgclf/forecast.py',
             '"efficiency": min(1.0, alone["step_s"] / together["step_s"]),',
             '"efficiency": min(1.0, together["step_s"] / alone["step_s"]),',
             ('tests/test_forecast.py::test_cpu_ranks_are_measured_alone_and_side_by_side',),
             'the measured efficiency must equal min(1, alone / together); the old test only asked 0 < e <= 1'),
    Mutation('cpu-rank-forecast-on-one-cpu', 'workflow/rules/resources.smk',
             '    return node_cpus(wildcards) if hw(wildcards)["accelerator"] == "cpu" else 1',
             '    return 1',
             ('tests/test_slurm_shapes.py::test_jobs_that_take_a_node_ask_for_its_cpus_from_a_smaller_login_node',),
             "786cb1a's shape test plans an entry of CPU ranks on a node of 8 CPUs so that its forecast (which times the ranks) is checked for the node's CPUs against a login node's cap"),
    Mutation('cpu-rank-lr-runs-take-the-whole-node', 'workflow/rules/resources.smk',
             '    return budget.threads_for_run(int(wildcards.run), runs, entry["cpus_per_node"])',
             '    return entry["cpus_per_node"]',
             ('tests/test_slurm_shapes.py::test_jobs_that_take_a_node_ask_for_its_cpus_from_a_smaller_login_node',),
             "the same test checks the LR runs of CPU ranks: cpu8's 2 runs ask for 4 CPUs each, side by side (94bc992's rounds)"),
    Mutation('import-loop', 'src/imgclf/hardware.py',
             'from imgclf.errors import UserError',
             'from imgclf.errors import UserError\nif False:\n    from imgclf import devices  # noqa: F401',
             ('tests/test_structure.py::test_the_package_has_no_import_loop',),
             'tests/test_structure.py fails on an import loop (an import inside a block counts: devices imports hardware)'),
    Mutation('rule-code-misses-a-module-it-runs', 'workflow/rules/loader.smk',
             'code=code("loader_bench", *READS_IMAGES, "devices"),',
             'code=code("loader_bench", *READS_IMAGES),',
             ('tests/test_structure.py::test_each_rule_lists_the_code_its_stage_runs',),
             "the test derives each rule's code() from its stage's imports and fails when a rule misses one it runs (docs/reproducibility.md)"),
    Mutation('rank-dies-of-a-late-requeue-signal', 'src/imgclf/slurm/requeue.py',
             '        atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)',
             '        pass',
             ('tests/test_slurm.py::test_a_rank_ignores_the_requeue_signal_once_it_exits',),
             "Python restores SIGUSR1's default action at shutdown, so a signal just after a completed training ended the rank and failed the job"),
    Mutation('requeued-rank-holds-its-nodes-to-sigkill', 'src/imgclf/slurm/requeue.py',
             '    return signal.signal(signal.SIGTERM, signal.SIG_DFL)',
             '    return signal.getsignal(signal.SIGTERM)',
             ('tests/test_slurm.py::test_ranks_end_at_the_requeues_sigterm_or_train_on_when_it_is_refused',),
             "Lightning's SIGTERM handler only notes the requeue's SIGTERM and the rank held its nodes until the SIGKILL (the original test_a_requeued_rank_ends_at_slurms_sigterm was folded into this one in 4aeddd3)"),
    Mutation('sigterm-default-not-restored-before-scontrol', 'src/imgclf/train/callbacks.py',
             '        handler = requeue.end_at_sigterm()',
             '        handler = signal.getsignal(signal.SIGTERM)',
             ('tests/test_slurm.py::test_ranks_end_at_the_requeues_sigterm_or_train_on_when_it_is_refused',),
             "docs/benchmarks.md: before 4aeddd3 the two-rank test showed the mismatch 'every time' (one rank aborted, the other waited for the SIGKILL)"),
    Mutation('refused-requeue-asked-again', 'src/imgclf/train/callbacks.py',
             '        self.gave_up = True\n',
             '',
             ('tests/test_slurm.py::test_ranks_end_at_the_requeues_sigterm_or_train_on_when_it_is_refused',),
             "a refused requeue must be said once and not tried again ([refused] asserts one 'time limit is near')"),
    Mutation('handoff-records-the-resolved-root', 'src/imgclf/hydration/__init__.py',
             '        "root": root,',
             '        "root": report["root"],',
             ('tests/test_reproducibility.py::test_rerun_check_with_same_census_reruns_nothing_after_it', 'tests/test_reproducibility.py::test_every_json_artifact_carries_complete_provenance'),
             'docs/benchmarks.md: both tests failed in the copied complete run because the hand-off recorded the data root resolved, so a moved workflow folder handed off other bytes'),
    Mutation('fork-server-workers-outlive-their-rank', 'src/imgclf/data.py',
             '        threading.Thread(target=self._exit_after_owner, daemon=True).start()\n',
             '',
             ('tests/test_train.py::test_fork_server_workers_end_when_their_rank_is_killed', 'tests/test_train.py::test_a_failure_on_rank_zero_ends_the_other_ranks'),
             "docs/benchmarks.md: fork-server workers are the server's children, so rank 1's lived on and test_a_failure_on_rank_zero_ends_the_other_ranks waited on their pipes until its timeout"),
    Mutation('gpu-lock-held-by-forked-workers', 'src/imgclf/devices.py',
             '        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)',
             '        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)',
             ('tests/test_hardware.py::test_a_gpu_is_free_when_its_job_ends_though_the_job_forked',),
             'with flock a loader worker that outlived its job kept the GPU from the next job (seen as a flaky LR-run scheduling test under load)'),
    Mutation('caption-without-look-for', 'workflow/report/noise_scale.rst',
             'marked. Look for where the planned batch sits',
             'marked. Where the planned batch sits',
             ('tests/test_reproducibility.py::test_report_embeds_every_figure_and_table_with_a_caption',),
             "every report caption must say what to look for; the noise scale's rewrite had dropped it"),
    Mutation('rule-file-not-snakefmt-formatted', 'workflow/rules/forecast.smk',
             '        code=code(\n            "forecast",\n            "artifacts",\n            "budget",\n            "devices",\n            "hardware",\n            "index",\n            "recipes",\n        ),',
             '        code=code("forecast", "artifacts", "budget", "devices", "hardware", "index", "recipes"),',
             ('tests/test_reproducibility.py::test_workflow_files_are_snakefmt_formatted',),
             "CI's snakefmt check failed when forecast.smk's code list grew past the line length"),
    Mutation('documented-command-without-a-reason', 'tests/test_commands.py',
             '    ".venv/bin/python benchmarks/gpu.py": "it needs a CUDA GPU",\n',
             '',
             ('tests/test_commands.py::test_every_documented_command_says_how_it_runs_here',),
             'every command the documents show must say how it runs here; benchmarks/gpu.py is listed with its reason (test-side edit: docs/ are what the test reads)'),
    Mutation('provenance-check-ignores-versions', 'src/imgclf/provenance.py',
             '        if was != now:',
             '        if False:',
             ('tests/test_reproducibility.py::test_provenance_check_exits_1_on_a_difference_and_names_the_package',),
             "at the minimum versions the test's torch 2.4.0 equalled the installed one and no difference showed; with 0.0.1 a check that ignores versions fails it"),
    Mutation('merge-keeps-the-killed-epochs-row', 'src/imgclf/train/summary.py',
             '            frame = frame[frame["epoch"] < later[0]]',
             '            frame = frame[frame["epoch"] <= later[0]]',
             ('tests/test_train.py::test_merge_metrics_drops_rows_redone_after_resume',),
             "the merged metrics must keep the redone epoch's row from the attempt that resumed, not the killed attempt's partial one"),
    Mutation('recipe-sampler-not-used', 'src/imgclf/train/module.py',
             '        if self.recipe.repeated_aug > 1:',
             '        if False:',
             ('tests/test_train.py::test_published_recipe_trains_with_its_weight_average_and_sampler',),
             'train_summary.json records the sampler training drew from, asserted RepeatedAugSampler for a recipe with repeated augmentation'),
    Mutation('valley-keeps-non-finite-losses', 'src/imgclf/lr/summary.py',
             '    lrs, losses = _window(lrs, losses, skip_start, skip_end)\n    n = len(losses)',
             '    lrs, losses = (np.asarray(lrs, float)[skip_start:-skip_end],\n                   np.asarray(losses, float)[skip_start:-skip_end])\n    n = len(losses)',
             ('tests/test_lr.py::test_non_finite_losses_are_dropped_first',),
             'the valley suggestion is now compared with the one from the filtered curve (it was only asserted not None)'),
    Mutation('gpu-pool-of-zero-gpus', 'src/imgclf/slurm/jobs.py',
             '    if count:\n        workflow.register_resource("gpu", count)',
             '    workflow.register_resource("gpu", count)',
             ('tests/test_foundation.py::test_slurm_jobs_keep_their_gpu_requests_from_a_login_node_without_gpus',),
             "a login node's pool of 0 GPUs lowered every LR run's GPU request to 0 (catches only on a machine without GPUs)"),
    Mutation('no-local-gpu-pool', 'src/imgclf/slurm/jobs.py',
             '    if "gpu" in workflow.global_resources or workflow_on_slurm(workflow):',
             '    if True:',
             ('tests/test_lr.py::test_lr_runs_take_one_gpu_each_and_never_more_than_there_are',),
             'without a pool from the detected GPUs, more GPU jobs ran at once than there are GPUs'),
    Mutation('gpu-model-matched-as-a-substring', 'src/imgclf/cuda_builds.py',
             '    return bool(model.strip()) and re.search(pattern, name.lower()) is not None',
             '    return bool(model.strip()) and model.strip().lower() in name.lower()',
             ('tests/test_hardware.py::test_gpu_model_is_matched_as_a_whole_word', 'tests/test_hardware.py::test_an_l4_does_not_stand_in_for_an_l40s'),
             'an L4 entry matched an L40S and A10 an A100'),
    Mutation('progress-postfix-redraws', 'src/imgclf/progress.py',
             '        super().set_postfix_str(s, refresh=False)',
             '        super().set_postfix_str(s, refresh=refresh)',
             ('tests/test_foundation.py::test_progress_in_a_log_advances_and_never_repeats_a_line',),
             'outside a terminal a postfix redraw logged the line before it again (0/7 fourteen times)'),
    Mutation('planning-imports-matplotlib', 'src/imgclf/artifacts.py',
             'from imgclf.provenance import read_json',
             'from imgclf.provenance import read_json\nimport matplotlib  # noqa: E402,F401',
             ('tests/test_foundation.py::test_planning_imports_neither_torch_nor_matplotlib',),
             'census_key (now artifacts.handoff_key) is imported by every Snakemake command; matplotlib there cost every dry run'),
    Mutation('lr-summary-imports-torch', 'src/imgclf/recipes.py',
             'from imgclf.errors import UserError',
             'from imgclf.errors import UserError\nimport torch  # noqa: E402,F401',
             ('tests/test_foundation.py::test_the_lr_summary_starts_without_torch',),
             'recipes.py imported torch at module level and the LR summary spent 2.5 s of its start on it'),
    Mutation('odd-fraction-takes-one-oversized-batch', 'src/imgclf/batch/grid.py',
             '        accumulate = max(1, math.ceil(micro - 1e-9))',
             '        accumulate = max(1, math.floor(micro + 1e-9))',
             ('tests/test_batch_curve.py::test_a_larger_batch_accumulates_and_a_smaller_one_never_grows_a_device_batch',),
             '0.5 of 3 batches took one per-device batch of 96 where the memory solve allowed 64'),
    Mutation('diverged-plan-run-gives-a-target', 'src/imgclf/batch/grid.py',
             '    if not all(math.isfinite(loss) for _, loss in points):',
             '    if False:',
             ('tests/test_batch_curve.py::test_a_run_steps_on_whole_accumulation_groups_and_validates_on_its_steps',),
             'a plan-batch run that diverged still gave a target from its last finite validations'),
    Mutation('rank-forks-its-loader-workers', 'src/imgclf/data.py',
             'multiprocessing_context=forkserver_context(forkserver_preload) if forkserver else None,',
             'multiprocessing_context=None,',
             ('tests/test_train.py::test_training_loader_workers_start_from_a_fork_server',),
             "docs/benchmarks.md (ae7550d): a rank's forked worker hung for good under Python 3.11 (gh-112275); workers must start from the fork server"),
    # --- jobs sized like their work, under cgroups ---------------------------------------------
    Mutation("gres-type-lower-cased", "src/imgclf/slurm/jobs.py",
             'return str(cluster["slurm_gpu_type"])', 'return str(cluster["slurm_gpu_type"]).lower()',
             ("tests/test_slurm_shapes.py::test_every_job_asks_for_the_entrys_gpus_or_none",),
             "Slurm compares GRES types case-sensitively: `Tesla_V100` must stay as written"),
    Mutation("one-gpu-job-on-one-cpu", "workflow/rules/resources.smk",
             "return slurm_jobs.job_device_cpus(workflow, hw(wildcards))", "return 1",
             ("tests/test_slurm_shapes.py::"
              "test_a_job_of_one_device_asks_for_the_share_its_loader_plan_assumes",),
             "a job of one GPU asked for 1 CPU and ran the plan's 12 workers on it"),
    Mutation("memory-per-cpu-of-the-job", "src/imgclf/slurm/jobs.py",
             "return node_memory_mb(cluster) * min(cpus, used) // used // cpus",
             "return node_memory_mb(cluster) // cpus",
             ("tests/test_hardware.py::"
              "test_a_job_of_one_device_gets_its_share_where_cpus_do_not_divide",),
             "memory per CPU divided by the job's CPUs: a one-CPU job asks for 90 % of the node"),
    Mutation("device-share-of-unequal-cpus", "src/imgclf/slurm/jobs.py",
             "used = min(int(cluster[\"cpus_per_node\"]),\n"
             "               device_cpus(cluster) * int(cluster[\"devices_per_node\"]))",
             "used = int(cluster[\"cpus_per_node\"])",
             ("tests/test_hardware.py::"
              "test_a_job_of_one_device_gets_its_share_where_cpus_do_not_divide",),
             "16 CPUs for 3 GPUs: a job of 5 CPUs got 5/16 of the memory, below a third"),
    Mutation("lock-folder-follows-tmpdir", "src/imgclf/devices.py",
             'LOCK_DIR = Path("/tmp")',
             'LOCK_DIR = Path(__import__("tempfile").gettempdir())',
             ("tests/test_hardware.py::"
              "test_a_second_user_under_umask_022_claims_gpus_beside_the_first",),
             "two users with their own TMPDIR lock in two folders and both claim GPU 0"),
    Mutation("batch-run-digest-without-its-budget", "src/imgclf/train/resume.py",
             '**({"run": run.learned()} if run else {}),  # absent from a real training\'s digest',
             "",
             ("tests/test_train.py::test_digest_covers_data_census_and_ignores_bookkeeping_keys",),
             "a batch-curve run resumed a checkpoint of another budget or target (a short run's "
             "digest now takes its whole shape, artifacts.RunShape.learned)"),
    Mutation("no-spare-start-in-the-deadline", "src/imgclf/slurm/jobs.py",
             "starts += starts > 1", "starts += 0",
             ("tests/test_slurm.py::"
              "test_training_asks_for_its_forecast_time_and_requeues_at_the_partition_limit",),
             "a requeued job's waits must fit the deadline it was submitted with"),
    Mutation("a-requeued-job-could-not-start", "src/imgclf/slurm/plugin.py",
             "        if runs:\n", "        if False:\n",
             ("tests/test_slurm.py::test_a_job_removed_at_its_deadline_is_explained",),
             "a job that ran and requeued itself was said never to have started"),
    Mutation("loader-benchmark-skips-the-build-check", "src/imgclf/loader_bench/__init__.py",
             'device = devices.claim_device(hw, "32", f"The loader benchmark of cluster '
             '{hw[\'name\']!r}")',
             'device = devices.claim_gpus(1, "The loader benchmark", hw) or torch.cuda.is_available()',
             ("tests/test_hardware.py::"
              "test_each_gpu_stage_claims_its_gpu_before_it_checks_the_build[loader benchmark]",),
             "on a node whose driver is too old the benchmark failed inside CUDA"),
    Mutation("short-run-of-no-time", "src/imgclf/forecast.py",
             "return micro_batches * step_s + validations * val_batches * eval_s", "return 0.0",
             ("tests/test_forecast.py::test_a_short_runs_time_is_its_budget_at_the_lr_runs_pace",),
             "the LR validation's and batch curve's runs asked for a fixed time (the seconds a "
             "short run's shape states now come from forecast.run_seconds, which replaced "
             "slurm/jobs.short_run_seconds)"),
    Mutation("plan-beyond-the-job-memory-runs", "src/imgclf/devices.py",
             "if memory is not None and need is not None and need * processes > memory:",
             "if False:",
             ("tests/test_hardware.py::"
              "test_a_plan_that_needs_more_memory_than_its_job_may_use_stops_it",),
             "a plan above the job's cgroup limit was killed partway instead of refused"),
    Mutation("cgroup-limit-of-the-leaf-only", "src/imgclf/hardware.py",
             "for depth in range(len(parts), -1, -1):", "for depth in (len(parts),):",
             ("tests/test_hardware.py::test_a_jobs_memory_limit_is_read_from_its_cgroups_v1_and_v2",),
             "Slurm sets the limit on the job's cgroup, above the task's"),
    Mutation("login-node-build-unsaid", "src/imgclf/cuda_builds.py",
             'f"build, on NVIDIA driver {MIN_DRIVER[13]} or newer, which this machine "',
             'f"build, which this machine "',
             ("tests/test_hardware.py::"
              "test_an_environment_built_elsewhere_gets_the_build_its_hardware_needs",),
             "a login node chose CUDA 13 for compute nodes whose driver it cannot see"),
    Mutation("resume-replays-the-epoch", "src/imgclf/data.py",
             "self.sampler.skip(self._handed * self.batch_size)", "self.sampler.skip(0)",
             ("tests/test_resume.py::"
              "test_a_requeued_epoch_trains_on_what_an_uninterrupted_one_would",),
             "a requeued epoch trained its first batches twice and its last never"),
    Mutation("requeue-save-inside-a-group", "src/imgclf/train/callbacks.py",
             "self.period = group_multiple(self.every, trainer.accumulate_grad_batches)",
             "self.period = self.every",
             ("tests/test_resume.py::test_the_requeue_saves_between_accumulation_groups",),
             "a save inside an accumulation group lost its partial gradients"),
    Mutation("compile-pool-dies-of-the-signal", "src/imgclf/train/module.py",
             "    with data.noted_signals_blocked():\n"
             "        from torch._inductor.async_compile import AsyncCompile\n\n"
             "        AsyncCompile.warm_pool()",
             "    from torch._inductor.async_compile import AsyncCompile\n\n"
             "    AsyncCompile.warm_pool()",
             ("tests/test_train.py::"
              "test_the_requeue_signal_leaves_a_ranks_compile_workers_compiling",),
             "Slurm's requeue signal killed Inductor's compile worker pool"),
    # --- the batch curve's fit, refusals and budgets ------------------------------------------
    Mutation("batch-fit-unweighted", "src/imgclf/batch/curve.py",
             "design, w = np.stack([np.ones_like(x), x], axis=1), 1 / y",
             "design, w = np.stack([np.ones_like(x), x], axis=1), np.ones_like(y)",
             ("tests/test_batch_curve.py::test_the_fit_weighs_each_batchs_steps_by_their_inverse",),
             "the fit is least squares in relative errors (MODEL); unweighted, 10 % too many steps "
             "at the smallest batch moved B_crit from 585 to 677, and the old test's interval "
             "still held 512"),
    Mutation("batch-interval-of-50-percent", "src/imgclf/batch/curve.py",
             "[0.05, 0.95]", "[0.25, 0.75]",
             ("tests/test_batch_curve.py::"
              "test_the_90_percent_interval_holds_the_critical_batch_about_9_times_in_10",),
             "the sentence calls it a 90 % interval; a 50 % one held the critical batch of the "
             "one data set the old test tried"),
    Mutation("batch-above-threshold-moved", "src/imgclf/batch/curve.py",
             "if fitted > 2 * max(batches):", "if fitted > 4 * max(batches):",
             ("tests/test_batch_curve.py::"
              "test_the_bend_lies_beyond_past_twice_the_largest_or_half_the_smallest_batch",),
             "past twice the largest batch measured the fit is an extrapolation the advice must "
             "not price devices by"),
    Mutation("batch-below-threshold-moved", "src/imgclf/batch/curve.py",
             "if fitted < min(batches) / 2:", "if fitted < min(batches) / 4:",
             ("tests/test_batch_curve.py::"
              "test_the_bend_lies_beyond_past_twice_the_largest_or_half_the_smallest_batch",),
             "under half the smallest batch measured the fit is an extrapolation too"),
    Mutation("batch-below-told-as-above", "src/imgclf/batch/curve.py",
             'if f["where"] == "above"', 'if f["where"] != "within"',
             ("tests/test_batch_curve.py::test_steps_that_hardly_fell_say_more_devices_buy_little",),
             "steps that hardly fell were told that more devices would still pay"),
    Mutation("batch-curve-with-a-multiple-missing", "src/imgclf/batch/curve.py",
             "if missing or 1.0 not in multiples:", "if 1.0 not in multiples:",
             ("tests/test_batch_curve.py::test_a_curve_needs_a_run_of_every_multiple",),
             "a curve was made from fewer batches than `batch_curve.multiples` names"),
    Mutation("batch-curve-from-one-batch", "src/imgclf/batch/curve.py",
             "if len(reached) < 2:", "if len(reached) < 1:",
             ("tests/test_batch_curve.py::test_a_curve_needs_two_batches_that_reached_the_target",),
             "a fit of one batch that reached the target has no critical batch to speak of"),
    Mutation("batch-run-at-another-batchs-lr", "src/imgclf/batch/grid.py",
             'if d["global_batch"] != run_shape["global_batch"]:', "if False:",
             ("tests/test_batch_curve.py::test_a_range_test_of_another_batch_is_refused",),
             "a run trained at the LR of a range test left from another plan's batch"),
    Mutation("batch-target-over-three-quarters", "src/imgclf/batch/grid.py",
             "if step > 0.75 * last]", "if step > 0.25 * last]",
             ("tests/test_batch_curve.py::"
              "test_the_target_is_the_median_over_the_last_quarter_of_the_plan_batchs_steps",),
             "every earlier test had too few validations for the last quarter and fell back to "
             "the last 3"),
    Mutation("batch-plan-steps-counts-batches", "src/imgclf/batch/grid.py",
             "return max(1, per_epoch // plan.accumulate_grad_batches) * epochs",
             "return max(1, per_epoch) * epochs",
             ("tests/test_batch_curve.py::test_the_planned_steps_count_optimizer_steps_not_batches",),
             "with accumulation the plan batch's budget (a fraction of the planned steps) "
             "doubled; no test planned with accumulation above 1"),
    Mutation("run-steps-on-a-partial-group", "src/imgclf/train/trainer.py",
             "        out[\"limit_train_batches\"] = run.limit_train_batches\n", "        pass\n",
             ("tests/test_batch_curve.py::"
              "test_lightning_steps_a_run_on_whole_accumulation_groups_only",),
             "Lightning steps on an epoch's last, partial accumulation group: a step of a smaller "
             "batch than the run's"),
    Mutation("lock-folder-under-the-users-umask", "src/imgclf/devices.py",
             "        os.chmod(path, 0o1777)\n", "",
             ("tests/test_hardware.py::"
              "test_the_lock_folder_and_its_files_are_writable_by_every_user_under_umask_022",),
             "made under umask 022 the lock folder is 0755, and no other user can create a lock "
             "file in it"),
    # --- the set-up's record of its lock, the memory search's floor, a job's memory -----------
    Mutation("set-up-records-no-lock", "run.sh",
             "            installed_from=$lock\n", "",
             ("tests/test_hardware.py::"
              "test_the_set_up_installs_from_the_lock_or_the_cuda_index_and_records_which",),
             "every artifact then names no lock; the old test read its expected digest from the "
             "file the code reads"),
    Mutation("verification-backs-off-to-batch-one", "src/imgclf/memory/measure.py",
             "batch = max(smallest, round_down(lower, round_to) if lower >= round_to else lower)",
             "batch = max(1, round_down(lower, round_to) if lower >= round_to else lower)",
             ("tests/test_memory.py::"
              "test_a_failed_verification_backs_off_no_lower_than_the_smallest_trainable_batch",),
             "on a small GPU at 32 px the verification backed off to batch 1 and batch norm's "
             "ValueError escaped the search"),
    Mutation("memory-solve-never-accumulates", "src/imgclf/memory/solve.py",
             'accum = accumulation(p.target, batch.per_device, p.devices, hw["nodes"])',
             "accum = 1",
             ("tests/test_memory.py::"
              "test_rule_accumulates_when_one_rank_cannot_hold_the_global_batch",),
             "one CPU rank held to 64 a batch planned a global batch of 64, not the recipe's 128"),
    Mutation("lr-finder-bar-redrawn", "src/imgclf/lr/find.py",
             'torch_lr_finder.lr_finder.tqdm = functools.partial(progress, desc=desc, unit="steps")',
             "pass",
             ("tests/test_lr.py::test_lr_stage_reports_progress_in_plain_lines",),
             "torch-lr-finder's tqdm bar redrew itself at every step in Snakemake's output"),
    Mutation("onnx-exporter-logs-its-passes", "src/imgclf/stage.py",
             '("matplotlib", "PIL", "onnx_ir", "onnxscript")', '("matplotlib", "PIL")',
             ("tests/test_predict.py::"
              "test_the_export_log_holds_the_stages_lines_not_its_libraries_steps",),
             "each export printed a dozen INFO lines of the ONNX exporter's passes"),
    Mutation("memory-per-cpu-over-the-jobs-cpus", "src/imgclf/slurm/jobs.py",
             "return node_memory_mb(cluster) * min(cpus, used) // used // cpus",
             "return node_memory_mb(cluster) * min(cpus, used) // cpus // cpus",
             ("tests/test_slurm_shapes.py::"
              "test_a_job_of_one_device_asks_for_the_share_its_loader_plan_assumes",),
             "divided by the job's CPUs, not the node's, a job of one GPU asks for all of the "
             "node's memory (one CPU: 90 % of the node); caught where the sbatch lines are "
             "judged, beside test_hardware's unit test (memory-per-cpu-of-the-job)"),
    # --- what the tests that read shared runs still catch --------------------------------------
    Mutation("lr-summary-arithmetic-mean", "src/imgclf/lr/summary.py",
             "suggested = float(np.exp(np.median(np.log(valid))))",
             "suggested = float(np.mean(valid))",
             ("tests/test_lr.py::test_aggregation_log_median_spread_and_excluded_run",),
             "the runs' suggestions agree in log space: their arithmetic mean leans to the "
             "largest; a real stage's runs may suggest the same LR, where mean and median "
             "agree, so a unit test with three suggestions catches it"),
    Mutation("lr-runs-share-one-seed", "src/imgclf/lr/find.py",
             'seed = cfg["seed"] + run',
             'seed = cfg["seed"]',
             ("tests/test_lr.py::test_lr_stage_aggregates_its_runs",),
             "repeated range tests of one seed repeat one curve: no spread to aggregate"),
    Mutation("lr-runs-unseeded", "src/imgclf/one_device.py",
             "torch.manual_seed(seed)",
             'torch.manual_seed(__import__("os").getpid())',
             ("tests/test_reproducibility.py::test_two_runs_agree_up_to_training_on_the_cpu",),
             "a range test whose initialisation is not its seed's differs from run to run"),
    Mutation("training-unseeded", "src/imgclf/train/__init__.py",
             'L.seed_everything(job.t["seed"], workers=True, verbose=False)',
             'L.seed_everything(__import__("os").getpid(), workers=True, verbose=False)',
             ("tests/test_pipeline.py::test_killed_training_resumes_from_last_checkpoint",),
             "a training seeded by anything but `train.seed` gives another model each run"),
    Mutation("forked-call-ignores-sigint", "tests/snakemake_fork.py",
             "        signal.signal(signal.SIGINT, signal.default_int_handler)\n",
             "        pass\n",
             ("tests/test_foundation.py::"
              "test_a_snakemake_call_past_its_time_stops_its_job_and_the_next_call_runs",),
             "a forked call inherits the forking process's ignored SIGINT: Snakemake would not "
             "stop its jobs on it, and a call past its time would wait a minute for SIGKILL "
             "(test infrastructure)"),
    Mutation("lr-validation-run-without-accumulation", "src/imgclf/lr/shape.py",
             "accumulate_grad_batches=plan.accumulate_grad_batches, epochs=run_epochs,",
             "accumulate_grad_batches=1, epochs=run_epochs,",
             ("tests/test_lr_validation.py::test_stage_writes_the_grid_verdict_and_plot",),
             "an LR validation run must train at the plan's batch, its accumulation included: "
             "at accumulation 1 it validates the LR at a smaller batch than training's"),
    Mutation("broken-file-read-again-on-resume", "src/imgclf/train/__init__.py",
             "job.recipe.name, read_bad_files(bad_list))",
             "job.recipe.name, set())",
             ("tests/test_data_flaws.py::"
              "test_file_broken_after_the_check_stops_training_then_resumes",),
             "a training that resumes after an image broke must leave out the files the stopped "
             "attempt listed, or it stops on the same image again"),
    # --- export ---
    Mutation('export-replaces-any-folder', 'src/imgclf/model_folder.py',
             '    if not names or (not foreign and is_export(folder)):',
             '    if True:',
             ('tests/test_export.py::test_a_folder_of_other_files_is_refused_and_left_as_it_was',),
             "`imgclf export --out-dir ~/models` deleted the notes and other projects' weights in the folder"),
    Mutation('export-describes-the-configs-recipe', 'src/imgclf/export.py',
             '    return recipes.get(name)\n',
             '    return recipes.get(model_cfg["recipe"])\n',
             ('tests/test_export.py::test_the_export_describes_the_recipe_the_checkpoint_trained_with',),
             "model.json gave the preprocessing of the recipe the config names, not the one the checkpoint trained with"),
    Mutation('export-checks-every-image', 'workflow/schemas/config.schema.yaml',
             '          - {$ref: "#/$defs/positive_int"}\n        default: 1000\n',
             '          - {$ref: "#/$defs/positive_int"}\n        default: null\n',
             ('tests/test_export.py::test_the_onnx_check_takes_a_fixed_sample_of_a_large_set',),
             "the export job checked the ONNX model on every validation image: hours of CPU on ImageNet, past the Slurm profile's 60 minutes"),
    # --- init_from ---
    Mutation('init-from-own-checkpoint-accepted', 'src/imgclf/weights.py',
             '    return len(parts) >= 2 and parts[1] == cluster\n',
             '    return parts[:2] == ("export", cluster)\n',
             ('tests/test_init_from.py::test_the_entrys_own_checkpoints_are_refused_before_training_deletes_them',),
             "`model.init_from` at the entry's own best.ckpt or last.ckpt was accepted: the new params reran training, Snakemake deleted the file first, and the run failed on it"),
    Mutation('init-from-unread-at-validation', 'src/imgclf/weights.py',
             '        read(path)\n        _READABLE.add(key)\n',
             '        _READABLE.add(key)\n',
             ('tests/test_init_from.py::test_an_unreadable_file_stops_the_workflow_with_one_sentence_once',),
             "a file that is no weights file passed validation and failed in every job that loads it, once per parallel LR run"),
    Mutation('init-from-text-file-traceback', 'src/imgclf/weights.py',
             '    except Exception as e:  # an unpickler fed garbage raises whatever it trips on\n',
             '    except (RuntimeError, EOFError, OSError, ValueError) as e:\n',
             ('tests/test_init_from.py::test_a_text_or_html_file_is_one_sentence',),
             "a plain text file as `model.init_from` ended in tracebacks (KeyError: 101) instead of the sentence"),
    Mutation('init-from-training-script-args-refused', 'src/imgclf/weights.py',
             '    with torch.serialization.safe_globals(list(TRUSTED)):\n',
             '    with torch.serialization.safe_globals([]):\n',
             ('tests/test_init_from.py::test_timm_and_torchvision_training_checkpoints_load_their_ema',),
             "the checkpoints of timm's and torchvision's train.py (with their argparse.Namespace `args`) could not be read"),
    # --- the GPU locks, threads and job limits ---
    Mutation("gpu-locks-in-a-folder-the-first-user-owns", "src/imgclf/devices.py",
             'LOCK_DIR = Path("/tmp")',
             'LOCK_DIR = Path("/tmp") / f"imgclf-gpu-locks-{os.getpid()}"',
             ("tests/test_hardware.py::"
              "test_a_user_claims_gpus_after_another_users_job_made_the_first_locks",),
             "a lock folder the first user's job made belongs to that user, and every other "
             "user's GPU jobs then refuse it"),
    Mutation('gpu-lock-followed-through-a-link', 'src/imgclf/devices.py',
             'return _lock_file(path, os.open(path, os.O_RDWR | os.O_NOFOLLOW))',
             'return _lock_file(path, os.open(path, os.O_RDWR))',
             ('tests/test_hardware.py::test_a_lock_file_another_user_linked_to_your_file_leaves_it_untouched',),
             "another user's symbolic link in the lock folder made a GPU job truncate the file it pointed to and write its pid there"),
    Mutation('gpu-lock-folder-not-sticky-accepted', 'src/imgclf/devices.py',
             'if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:',
             'if False:',
             ('tests/test_hardware.py::test_a_lock_folder_another_user_could_swap_files_in_is_one_sentence',),
             'a lock folder writable by all without the sticky bit was used as found: any user could replace the lock files in it'),
    Mutation('gpu-lock-folder-of-another-user-accepted', 'src/imgclf/devices.py',
             'if st.st_uid not in (0, os.geteuid()):',
             'if False:',
             ('tests/test_hardware.py::test_a_lock_folder_another_user_could_swap_files_in_is_one_sentence',),
             "a lock folder another user made (and may empty and refill) was used as found"),
    Mutation('gpu-rank-keeps-the-jobs-threads', 'src/imgclf/train/trainer.py',
             '    threads = slurm_task.cpu_threads_per_rank(int(cluster["devices_per_node"]))\n',
             '    threads = torch.get_num_threads() if cluster["accelerator"] == "gpu" else slurm_task.cpu_threads_per_rank(int(cluster["devices_per_node"]))\n',
             ('tests/test_slurm.py::test_a_gpu_rank_of_p4_computes_on_its_share_of_the_node_not_on_every_cpu',),
             "GPU training ranks kept the OMP_NUM_THREADS Snakemake exports (96 on p4) in a share of 12 CPUs"),
    Mutation('memory-solve-without-job-limits', 'src/imgclf/memory/measure.py',
             '    devices.log_limits(f"The memory solve of cluster {hw[\'name\']!r}",\n',
             '    (f"The memory solve of cluster {hw[\'name\']!r}",\n',
             ('tests/test_memory.py::test_the_measured_solve_logs_what_its_job_may_use',),
             "the measured memory solve logged no job limits, unlike training, evaluation and the LR runs"),
    Mutation('predict-without-job-limits', 'src/imgclf/predict.py',
             '    devices.log_limits("Prediction", f"; it decodes with {workers} worker(s)")\n',
             '',
             ('tests/test_predict.py::test_predict_says_what_its_job_may_use',),
             "imgclf predict logged no job limits, unlike training, evaluation and the LR runs"),
    Mutation('resume-after-a-broken-file-draws-afresh', 'src/imgclf/sampling.py',
             'self._left_out = list(resume.get("left_out", now)) if same else now',
             'self._left_out = now',
             ('tests/test_resume.py::test_a_resume_after_a_broken_file_was_left_out_keeps_the_epochs_order',),
             "a mid-epoch resume after a broken file was left out dealt a fresh permutation of the smaller data set: some files of the epoch trained twice, others never"),
    # --- decoding and predict ---
    Mutation('tensor-decoder-hands-torchvision-gif-and-webp', 'src/imgclf/decoding.py',
             'TORCHVISION = {"JPEG": ("RGB", "L")}',
             'TORCHVISION = {"JPEG": ("RGB", "L"), "GIF": ("P", "L", "RGB"), "WEBP": ("RGB", "RGBA")}',
             ('tests/test_decoding.py::test_every_format_decodes_to_one_rgb_image_with_either_decoder',),
             "the tensor decoder gave every frame of an animated GIF (`imgclf predict` stopped on the whole folder: stack expects each tensor to be equal size) and refused an animated WebP"),
    Mutation('tensor-decoder-hands-torchvision-every-format', 'src/imgclf/decoding.py',
             '    if image.mode in TORCHVISION.get(image.format, ()):\n',
             '    if True:\n',
             ('tests/test_decoding.py::test_every_format_decodes_to_one_rgb_image_with_either_decoder',),
             "the tensor decoder refused BMP, TIFF, PPM and PGM, which the hydration check accepts, and gave a 16-bit PNG as uint16"),
    Mutation('sixteen-bit-grey-clipped-to-white', 'src/imgclf/decoding.py',
             '    if image.mode in SIXTEEN_BIT:\n',
             '    if False:\n',
             ('tests/test_decoding.py::test_every_format_decodes_to_one_rgb_image_with_either_decoder',),
             "PIL's conversion of a 16-bit grey PNG, TIFF or PGM clipped it to near white: predict, evaluation and training answered wrongly and silently"),
    Mutation('check-accepts-what-no-decoder-makes-rgb', 'src/imgclf/hydration/integrity.py',
             '            to_rgb(img)  # what either decoder does with it',
             '            img.load()  # what either decoder does with it',
             ('tests/test_decoding.py::test_every_file_the_check_accepts_decodes_with_each_loader_decoder',),
             "the check accepted a grey TIFF with premultiplied alpha, whose pixels neither decoder makes RGB of: training would stop on it"),
    Mutation('onnx-example-clips-sixteen-bit', 'docs/training.md',
             '    if image.mode.startswith("I"):  # 16-bit grey',
             '    if False:  # 16-bit grey',
             ('tests/test_predict.py::test_the_onnxruntime_example_reproduces_the_predictions',),
             "the docs' onnxruntime example read a 16-bit grey PNG as near white, unlike imgclf predict"),
    Mutation('predict-skips-linked-folders', 'src/imgclf/predict_files.py',
             'os.walk(folder, followlinks=True)',
             'os.walk(folder)',
             ('tests/test_predict.py::test_a_folder_is_searched_through_its_links_once',),
             "images under a linked subfolder got no row and no warning"),
    Mutation('non-image-named-by-its-python-object', 'src/imgclf/images.py',
             '        raise UnidentifiedImageError(NOT_AN_IMAGE) from None\n',
             '        raise\n',
             ('tests/test_decoding.py::test_a_file_that_is_no_image_is_said_to_be_none',),
             "a text file's row said `cannot identify image file <_io.BytesIO object at 0x7f...>`"),
    Mutation('predict-out-folder-traceback', 'src/imgclf/predict.py',
             '    if os.path.isdir(out_csv):\n',
             '    if False:\n',
             ('tests/test_predict.py::test_predict_names_a_folder_given_as_its_out_file',),
             "`--out` naming an existing folder ended in an IsADirectoryError traceback"),
    Mutation('predict-csv-blind-to-its-files', 'src/imgclf/slices.py',
             '"files": predict_files.state(path), ',
             '',
             ('tests/test_predict.py::test_the_predict_rule_reruns_when_the_sets_files_change',),
             "a set's CSV never reran when its images were added, removed or replaced"),
    # --- the first hour ---
    Mutation('finetune-example-without-its-recipe', 'README.md',
             'resnet18-f37072fd.pth, recipe: finetune}',
             'resnet18-f37072fd.pth}',
             ('tests/test_commands.py::test_a_documented_fine_tuning_config_runs_the_recipe_the_docs_recommend',),
             "the README's fine-tuning line started from the weights with the default recipe, not the one docs/training.md recommends"),
    Mutation('hydration-failure-hides-the-second-problem', 'src/imgclf/hydration/__init__.py',
             'shown = "; ".join(f"({i}) {r}" for i, r in enumerate(reasons[:limit], 1))',
             'shown = "; ".join(f"({i}) {r}" for i, r in enumerate(reasons[:1], 1))',
             ('tests/test_data_flaws.py::test_folder_problems_fail_in_one_sentence_with_the_findings_kept',),
             "an empty class folder's second problem (its class missing from val/) was hidden behind a count"),
    Mutation('empty-class-folder-without-its-fix', 'src/imgclf/census.py',
             'holds no usable image: put the "\n                                f"class\'s images in it, or remove it")',
             'holds no usable image")',
             ('tests/test_data_flaws.py::test_folder_problems_fail_in_one_sentence_with_the_findings_kept',),
             "the failure named the empty class folder but not what to do about it"),
    Mutation('misspelt-key-without-did-you-mean', 'src/imgclf/settings.py',
             'if (close := difflib.get_close_matches(key, allowed, 1))]',
             'if (close := difflib.get_close_matches(key, allowed, 0))]',
             ('tests/test_foundation.py::test_bad_config_stops_with_one_sentence',),
             "a misspelt config key listed every allowed key without pointing at the one meant"),
    Mutation('run-ends-without-what-it-made', 'src/imgclf/run_end.py',
             '    print_at_exit(summary(dag_outputs(workflow), clusters))',
             '    pass',
             ('tests/test_pipeline.py::test_the_complete_run_ends_with_what_it_made',),
             "a complete run ended on Snakemake's \"Complete log(s)\" line, its results to be found in the files"),
    Mutation('failed-run-ends-on-workflowerror', 'src/imgclf/run_end.py',
             'print_at_exit([*first, *failure(snakemake_logs)])',
             'print_at_exit(first)',
             ('tests/test_data_flaws.py::test_folder_problems_fail_in_one_sentence_with_the_findings_kept',),
             "a failed run's sentence sat above Snakemake's shell command line and WorkflowError"),
    Mutation('one-target-run-summarises-every-artifact', 'src/imgclf/run_end.py',
             'lines, made = [], {p for p in outputs if Path(p).exists()}',
             'lines, made = [], {str(p) for p in Path("results").rglob("*")}',
             ('tests/test_pipeline.py::test_a_run_of_one_target_tells_of_its_artifacts_alone',),
             "a run of one target must summarise that target's artifacts, not whatever results/ holds"),
    Mutation('report-opens-on-the-dag', 'workflow/rules/report.smk',
             'report: report_landing_page(config["cluster"])',
             'report: "../report/workflow.rst"',
             ('tests/test_reproducibility.py::test_report_embeds_every_figure_and_table_with_a_caption',),
             "the report opened on the DAG, its results a few clicks away"),
    Mutation('small-training-set-in-silence', 'src/imgclf/train/__init__.py',
             '        log.warning("%s", small)',
             '        log.debug("%s", small)',
             ('tests/test_train.py::test_a_training_set_smaller_than_one_global_batch_is_warned_of',),
             "a training set smaller than one global batch trained 1 step per epoch without a word"),
    Mutation('checkpoint-names-count-epochs-from-0', 'src/imgclf/train/trainer.py',
             'candidates["epoch"] = candidates["epoch"] + 1',
             'candidates["epoch"] = candidates["epoch"]',
             ('tests/test_pipeline.py::test_the_complete_runs_training_is_ddp_over_two_processes_through_the_cli',),
             "checkpoint names counted epochs from 0 while the progress lines count from 1"),
    Mutation('training-summary-counts-epochs-from-0', 'src/imgclf/train/summary.py',
             '"epoch": epoch + 1,',
             '"epoch": epoch,',
             ('tests/test_pipeline.py::test_the_complete_runs_training_is_ddp_over_two_processes_through_the_cli',),
             "the summary's best epoch counted from 0 while the progress lines count from 1"),
    Mutation('lr-range-test-ends-without-saying-how', 'src/imgclf/lr/find.py',
             '    ended(f"LR range test {run}", n, cfg["num_iter"], "steps",',
             '    (lambda *a: None)(f"LR range test {run}", n, cfg["num_iter"], "steps",',
             ('tests/test_lr.py::test_lr_stage_reports_progress_in_plain_lines',),
             "a range test stopped at divergence left \"17/20 steps (85 %)\" as its last progress line"),
    Mutation('recipe-lr-ignores-a-forced-scaling', 'src/imgclf/lr/scaling.py',
             'return lr_at_batch(cfg, recipe, recipe.lr, recipe.ref_batch, global_batch)',
             'return lr_at_batch({"scaling": "auto"}, recipe, recipe.lr, recipe.ref_batch, global_batch)',
             ('tests/test_lr.py::test_a_forced_scaling_moves_the_recipes_lr_for_the_report_and_training_alike',),
             "a forced `lr_finder.scaling` moved the LR finder's LR but not the recipe's, stated at its own batch"),
    Mutation('recipe-source-trains-at-the-optimizers-rule', 'src/imgclf/train/learning_rate.py',
             'recipe_lr(scaling, recipe, plan.global_batch)',
             'recipe_lr({"scaling": "auto"}, recipe, plan.global_batch)',
             ('tests/test_lr.py::test_a_forced_scaling_moves_the_recipes_lr_for_the_report_and_training_alike',),
             "`train.lr_source: recipe` trained at another recipe LR than the LR summary's `reference_lr` under a forced scaling"),
    Mutation('lr-summary-scales-from-the-first-runs-batch', 'src/imgclf/lr/summary.py',
             'method, from_batch = cfg["suggestion"], finder_batch(runs)',
             'method, from_batch = cfg["suggestion"], runs[0]["effective_batch"]',
             ('tests/test_lr.py::test_runs_made_at_different_batches_are_refused',),
             "LR runs made at different effective batches were combined and scaled from the first run's batch"),
    Mutation('short-runs-carry-the-recipe-scaling', 'src/imgclf/slices.py',
             '    params.pop("lr_finder", None)',
             '    pass',
             ('tests/test_lr.py::test_the_recipe_sources_scaling_never_replans_a_short_run',),
             "switching training to the recipe's LR would have redone every run of the LR validation"),
]


def scratch_copy(dest: Path) -> Path:
    """The checkout's files as a clone with the working tree's changes has them: tracked and
    untracked ones, not what git ignores (.venv, results, data)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def apply(root: Path, m: Mutation) -> None:
    path = root / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"{m.name}: {m.file} holds its `old` {count} times, not once: "
                         f"update the mutation to today's code")
    path.write_text(text.replace(m.old, m.new))


def outcome(output: str) -> str:
    """caught (a test failed), missed (its tests passed), broken (an error before any test
    could fail: the mutation no longer fits the code) or not run (skipped here)."""
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    if re.search(r"\d+ failed", summary):
        return "caught"
    if re.search(r"\d+ errors?\b", summary) or "no tests ran" in summary:
        return "broken"
    if re.search(r"\d+ passed", summary):
        return "missed"
    return "not run"


def run(m: Mutation) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mutation-{m.name}-") as tmp:
        root = scratch_copy(Path(tmp))
        apply(root, m)
        env = {**os.environ, **m.env,
               "PYTHONPATH": os.pathsep.join([str(root / "src"),
                                              os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist",
                              "-p", "no:cacheprovider", "-q", "-x", "-rs", *m.tests],
                             cwd=root, env=env, capture_output=True, text=True)
        out = res.stdout + res.stderr
        return outcome(res.stdout), time.monotonic() - t0, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="run only these mutations")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"no mutation named {', '.join(sorted(unknown))} (--list names them)")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file} ({m.why}); {' '.join(m.tests)}")
        return 0
    results = {}
    for m in chosen:
        got, seconds, out = run(m)
        results[m.name] = got
        print(f"{got:8} {seconds:6.0f} s  {m.name}", flush=True)
        if got != "caught":
            print("    " + "\n    ".join(out.strip().splitlines()[-8:]), flush=True)
    counts = {k: [n for n, r in results.items() if r == k]
              for k in ("caught", "missed", "broken", "not run")}
    print(", ".join(f"{len(v)} {k}" for k, v in counts.items())
          + " (not run: a test skipped here, for want of the Slurm cluster or root)")
    return 1 if counts["missed"] or counts["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
