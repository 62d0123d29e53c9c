"""`imgclf resources`: what each job of the workflow asks Slurm for on one hardware entry, and
why, in one table: its CPUs, memory, GPUs, time and partition, as the executor plugin submits
them. Otherwise a reader would piece a job's request together from its rule, the rules'
resources.smk, slurm.jobs, hardware and the profile.

The numbers come from the functions the rules' resources call (slurm.jobs, hardware,
budget.threads_for_run, the memory solve's gpus_to_request), with the Slurm executor's view
(`on_slurm`), and the profile's defaults below them. JOBS names, for each rule that becomes a
Slurm job, the resources.smk functions its `threads:` and `resources:` use (a test holds it to
the rules); a time that a run's artifact decides (the forecast, a short run's run.json) is
shown as what it depends on and its cap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgclf import budget, settings
from imgclf.errors import UserError
from imgclf.hardware import GB, MIB, device_cpus
from imgclf.memory.measure import gpus_to_request
from imgclf.slurm import jobs

PROFILE = settings.REPO / "profiles" / "slurm"


@dataclass(frozen=True)
class Job:
    """A rule submitted to Slurm: the resources.smk function of its threads (None: Snakemake's
    default of one thread), of its GPU count (`training`: the training's shape) and where its
    time comes from (`profile`, `forecast`, `run`)."""

    rule: str
    threads: str | None = None
    gpus: str | None = None
    time: str = "profile"


# In the order the workflow runs them
JOBS = (
    Job("prepare_demo_data"),
    Job("check_hydration", "node_cpus"),
    Job("benchmark_loader", "device_cpus", "one_device"),
    Job("solve_memory", "memory_cpus", "memory_gpus"),
    Job("lr_find", "lr_run_cpus", "one_device"),
    Job("summarize_lr"),
    Job("noise_scale", "rank_cpus", "one_device"),
    Job("forecast", "forecast_cpus"),
    Job("train_model", gpus="training", time="forecast"),
    Job("evaluate", "rank_cpus", "one_device"),
    Job("validate_lr_run", gpus="training", time="run"),
    Job("summarize_lr_validation"),
    Job("batch_lr_find", "rank_cpus", "one_device"),
    Job("batch_run", gpus="training", time="run"),
    Job("summarize_batch"),
    Job("export_model", "device_cpus"),
    Job("predict", "device_cpus", "one_device"),
)
# Rules that run where Snakemake runs (`localrule: True`): no Slurm job
LOCAL_RULES = ("train_settings", "validate_lr_shape", "validate_lr_edge",
               "validate_lr_extend_steps", "batch_run_shape", "plot_hydration", "plot_loader",
               "plot_memory", "plot_lr", "plot_noise", "plot_lr_validation", "plot_batch",
               "plot_training", "plot_evaluation", "report_table", "report_landing")


# --- the CPUs and GPUs of each kind of job: the one source of resources.smk's functions --------
# Each takes the entry, the config and `device`, one device's share of its node's CPUs as the
# submission sees it (under Slurm the entry's share, hardware.device_cpus; run here at most this
# machine's cores per GPU, slurm.jobs.job_device_cpus), and gives the CPUs of each of the job's
# tasks (one per LR run) and why.

def _cpu_ranks(entry: dict) -> bool:
    return entry["accelerator"] == "cpu"


def node_cpus(entry, config, device, on_slurm=True):
    return [int(entry["cpus_per_node"])], "the whole node: it decodes on every CPU"


def device_cpus_of(entry, config, device, on_slurm=True):
    return [device], "one device's share of the node"


def rank_cpus(entry, config, device, on_slurm=True):
    if _cpu_ranks(entry):
        return [int(entry["cpus_per_node"])], "the whole node: CPU ranks compute on it"
    return [device], "one GPU's share of the node"


def forecast_cpus(entry, config, device, on_slurm=True):
    if _cpu_ranks(entry):
        return [int(entry["cpus_per_node"])], "the whole node: it times the CPU ranks"
    return [1], "one CPU: it computes in a second"


def lr_run_cpus(entry, config, device, on_slurm=True):
    runs = config["lr_finder"]["runs"]
    if not _cpu_ranks(entry):
        return [device] * runs, f"one GPU's share of the node, each of {runs} runs"
    cpus = int(entry["cpus_per_node"])
    return ([budget.threads_for_run(run, runs, cpus) for run in range(runs)],
            f"the {runs} runs share the node's CPUs in rounds")


def memory_cpus(entry, config, device, on_slurm=True):
    if memory_gpus(entry, config, on_slurm):
        return [device], "one GPU's share: it measures on the GPU"
    return [1], "one CPU: it estimates (`memory.mode`, or no GPU)"


THREADS = {"node_cpus": node_cpus, "device_cpus": device_cpus_of, "rank_cpus": rank_cpus,
           "forecast_cpus": forecast_cpus, "lr_run_cpus": lr_run_cpus,
           "memory_cpus": memory_cpus}


def one_device(entry, config, on_slurm=True) -> int:
    """One GPU (or Apple's MPS, the local pool's one device), or none for an entry of CPU ranks,
    which a CPU partition without GPUs must accept."""
    return int(entry["accelerator"] != "cpu")


def memory_gpus(entry, config, on_slurm=True) -> int:
    """The memory solve's GPU: one where it may measure on one (memory.gpus_to_request)."""
    return gpus_to_request(config["memory"], entry, on_slurm)


GPUS = {"one_device": one_device, "memory_gpus": memory_gpus}


# --- one row per job --------------------------------------------------------------------------

@dataclass
class Request:
    """One job's request: the Snakemake resources the plugin turns into sbatch options (a time
    an artifact decides at its cap), its threads, and each column as the table shows it."""

    rule: str
    resources: dict
    threads: int
    why: str
    time: str


def profile_defaults(profile: Path) -> tuple[dict, dict]:
    """(default-resources, set-resources by rule) of a Snakemake profile folder."""
    import yaml

    path = Path(profile) / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise UserError(f"Profile file {path} does not exist: give `imgclf resources "
                        f"--profile` the folder of your Slurm profile.") from None
    except yaml.YAMLError as e:
        raise UserError(f"Profile file {path} is not valid YAML ({str(e).splitlines()[0]}): "
                        f"fix it, as Snakemake would refuse it too.") from None
    given = data.get("default-resources") or []
    # Snakemake takes either form: a list of `key=value` or a mapping
    pairs = given.items() if isinstance(given, dict) else \
        (str(item).split("=", 1) for item in given if "=" in str(item))
    return ({k.strip(): _value(v) for k, v in pairs},
            {rule: {k: _value(v) for k, v in res.items()}
             for rule, res in (data.get("set-resources") or {}).items()})


def _value(v):
    """A profile's resource value: a number, or a string Snakemake reads as one."""
    v = str(v).strip().strip("'\"")
    return int(v) if v.isdigit() else v


def requests(config: dict, entry: dict, profile=PROFILE) -> list[Request]:
    """Every Slurm job's request on `entry`, in JOBS' order (an LR run's on CPU ranks once per
    distinct share of the node's CPUs)."""
    defaults, per_rule = profile_defaults(profile)
    out = []
    for job in JOBS:
        counts, why = THREADS[job.threads](entry, config, device_cpus(entry)) if job.threads else \
            ([None], "no share of a node: the profile's defaults")
        for cpus in sorted(set(counts), key=counts.index):
            res, threads, why_job = _resources(job, entry, config, cpus, why)
            res = {**defaults, **res, **per_rule.get(job.rule, {})}
            k = counts.count(cpus)
            rule = job.rule if len(set(counts)) == 1 else f"{job.rule} ({k} run{'s' * (k > 1)})"
            out.append(Request(rule, res, threads, why_job, _time(job, res)))
    return out


def _resources(job: Job, entry: dict, config: dict, cpus, why: str) -> tuple[dict, int, str]:
    """(Snakemake resources under Slurm, threads, why) of one job of `cpus` CPUs."""
    if job.gpus == "training":
        res = jobs.train_resources(entry, True)
        res["runtime"] = jobs.time_request(None, entry)[0]  # the cap: the artifact decides
        return res, int(entry["cpus_per_node"]), _training_why(job)
    if cpus is None:
        return {}, 1, why
    res = jobs.cpu_resources(entry, cpus, True)
    count = GPUS[job.gpus](entry, config) if job.gpus else 0
    if job.gpus:
        res.update(jobs.gpu_resources(entry, count, True))
    if not count and entry["accelerator"] == "gpu":
        why += ", no GPU"
    return res, cpus, why


def _training_why(job: Job) -> str:
    if job.rule == "train_model":
        return "the training: a task per device, each with one device's share"
    return "the training's shape, for its step budget"


def _time(job: Job, res: dict) -> str:
    """The time column: the profile's, or what a run's artifact decides and its cap."""
    if job.time == "profile":
        return f"{res['runtime']} min (profile)" if "runtime" in res else \
            "the Slurm plugin's default (the profile sets no runtime)"
    source = ("forecast (none: the cap)" if job.time == "forecast" else
              "step budget at the measured pace (run.json `seconds`)")
    return (f"{source} x {jobs.RUNTIME_MARGIN:g} + {jobs.STARTUP_MINUTES} min, capped at "
            f"{res['runtime']:,}; requeues at the cap")


# --- the table --------------------------------------------------------------------------------

COLUMNS = ("rule", "CPUs", "memory", "GPUs", "time", "partition", "why")


def cells(req: Request) -> tuple[str, ...]:
    res = req.resources
    return (req.rule, _cpus(res, req.threads), _memory(res), _gpus(res), req.time,
            str(res.get("slurm_partition", "(the plugin's default)")), req.why)


def _cpus(res: dict, threads: int) -> str:
    if res.get("nodes"):  # the training's shape: tasks_per_node, or `tasks` of one a node
        nodes, per_node = res["nodes"], res.get("tasks_per_node") or 1
        return (f"{nodes} node{'s' * (nodes > 1)} x {per_node} task{'s' * (per_node > 1)} x "
                f"{res['cpus_per_task']}")
    return str(res.get("cpus_per_task") or threads)


def _memory(res: dict) -> str:
    if res.get("mem_mb_per_cpu"):
        # a job that sets no CPUs gets Slurm's default of one per task
        per_task = res["mem_mb_per_cpu"] * res.get("cpus_per_task", 1) * MIB / GB
        each = " a task" if res.get("nodes") else ""
        return f"{res['mem_mb_per_cpu']:,} MiB/CPU ({per_task:.1f} GB{each})"
    return f"{res.get('mem_mb', 0):,} MiB (profile)"


def _gpus(res: dict) -> str:
    """The GPU options the plugin writes (set_gres_string, and -C for a constraint)."""
    opts = []
    if res.get("gres"):
        opts.append(f"--gres={res['gres']}")
    if res.get("gpu_model"):
        opts.append(f"--gpus={res['gpu_model']}:{res.get('gpu') or 1}")
    elif res.get("gpu"):
        opts.append(f"--gpus={res['gpu']}")
    if res.get("constraint"):
        opts.append(f"-C {res['constraint']}")
    return " ".join(opts) or "none"


def render(rows: list[Request], markdown: bool) -> str:
    table = [COLUMNS, *map(cells, rows)]
    if markdown:  # options as code
        table[1:] = [(*row[:3], row[3] if row[3] == "none" else f"`{row[3]}`", *row[4:])
                     for row in table[1:]]
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table]
        lines.insert(1, "|" + "---|" * len(COLUMNS))
    else:
        width = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in table]
    local = ", ".join(f"`{r}`" if markdown else r for r in LOCAL_RULES)
    return "\n".join([*lines, "", f"No Slurm job (run where Snakemake runs): {local}."])


# --- the command ------------------------------------------------------------------------------

def cmd_resources(args) -> None:
    config = settings.load(args.configfile)
    name = args.cluster or config["cluster"]
    if name not in config["clusters"]:
        raise UserError(f"Unknown cluster {name!r} for `imgclf resources --cluster`: choose one "
                        f"of {', '.join(sorted(config['clusters']))}, or add an entry under "
                        f"`clusters:` in a --configfile.")
    print(render(requests(config, settings.cluster(config, name), args.profile), args.markdown))


def add_parser(sub) -> None:
    """The `resources` sub-command of the imgclf CLI."""
    p = sub.add_parser(
        "resources", help="what each job asks Slurm for on a hardware entry, and why",
        description="Print, for every rule, the CPUs, memory, GPUs, time and partition its "
                    "Slurm job asks for on a hardware entry, as the executor plugin submits "
                    "them, and why; a time a run decides (the forecast, a short run's step "
                    "budget) is shown with what it depends on and its cap.")
    p.add_argument("--cluster", default=None, help="hardware entry (default: config `cluster`)")
    p.add_argument("--configfile", action="append", default=[],
                   help="extra YAML config merged over config/config.yaml (repeatable)")
    p.add_argument("--profile", default=PROFILE, type=Path,
                   help="Snakemake profile folder whose default-resources and set-resources "
                        "complete the requests (default profiles/slurm)")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (docs/slurm.md)")
    p.set_defaults(fn=cmd_resources)
