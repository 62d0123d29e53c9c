"""The device a stage runs on and the precision it computes in: one layer for every stage.

Which GPUs a job uses, when several jobs share one machine's GPUs. Snakemake caps how many GPU
jobs run at once (the `gpu` resource), not which GPU each takes: two LR-finder runs that both
chose `cuda:0` would each size themselves to 85 % of it and run out of memory. So a job claims
its devices: an exclusive lock per device (a POSIX record lock, `lockf`, on a file named after
the device's UUID, held until the process ends, so a killed job frees its GPUs, and kept at its
path while held: `_try_lock`, `_keep_held`), then CUDA_VISIBLE_DEVICES set to them before CUDA
starts, so the job and every rank Lightning's launcher starts from it see exactly those. A
record lock belongs to the process alone: the loader workers it forks do not hold it (a `flock`
they would share, and a worker still shutting down would hold the GPU from the next job). Under
Slurm the scheduler gives each job its GPUs: a rank srun started claims nothing.

Once claimed, the torch build, the driver and the precision are checked against the devices
(`claim_device`), before the stage's first CUDA call. The config's `model.precision` maps to
autocast and loss scaling as Lightning trains it (`autocast`, `grad_scaler`), on every device:
the stages before training measure in the precision training runs in."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pwd
import stat
import threading
import time
from pathlib import Path

from imgclf import hardware
from imgclf.errors import UserError

log = logging.getLogger(__name__)
# The claim of the process that holds the locks, inherited by the ranks Lightning's launcher
# starts from it (they re-run the same command and must not claim again).
CLAIM_ENV = "IMGCLF_CLAIMED_GPUS"
WAIT_LOG_S = 60.0
GUARD_S = 60.0  # how often a job keeps its lock files young and at their paths (`_keep_held`)
_held: list = []  # (path, open lock file): the locks live as long as this process
# The GPU locks of this machine: one folder whatever a job's environment. Not
# tempfile.gettempdir(), which follows TMPDIR: Snakemake sets it for each job from its `tmpdir`
# resource, and users' differ (pam_tmpdir, per-user scratch), so that two users would each lock
# the same GPU in a folder of their own and both size their batch to 85 % of it. /tmp itself,
# not a folder of ours in it: /tmp is root's and sticky on every Linux, while a folder that the
# first user's job made would belong to that user, who could replace the others' lock files.
LOCK_DIR = Path("/tmp")


def lock_path(uuid: str) -> Path:
    """The lock file of device `uuid`."""
    return lock_dir() / f"imgclf-gpu-{uuid}.lock"


def lock_dir() -> Path:
    """LOCK_DIR, in which every user creates and locks files, once `check_lock_dir` found that
    no other user can replace the lock files in it. Never made here: /tmp exists on every
    Linux, and a folder this user made would be this user's, refused by every other user's job
    (a test that locks elsewhere makes its folder as /tmp is: tests/conftest.py)."""
    check_lock_dir(LOCK_DIR)
    return LOCK_DIR


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _overflow_uid() -> int:
    """The uid that a user namespace shows for a file whose owner it does not map."""
    try:
        return int(Path("/proc/sys/kernel/overflowuid").read_text())
    except (OSError, ValueError):
        return 65534


def _in_user_namespace() -> bool:
    """Whether this process runs in a user namespace (a rootless Apptainer or Podman
    container): its uids are not the host's, all of them one to one."""
    try:
        return Path("/proc/self/uid_map").read_text().split() != ["0", "0", "4294967295"]
    except OSError:
        return False


def _host_owned(st: os.stat_result) -> bool:
    """Whether a sticky folder is the host's /tmp as a rootless container shows it: owned by
    the overflow uid, which stands for root (or any host user) outside the container, and only
    inside a user namespace (outside one, that uid is the `nobody` user, whom daemons run as)."""
    return (st.st_uid == _overflow_uid() and bool(st.st_mode & stat.S_ISVTX)
            and _in_user_namespace())


def check_lock_dir(path: Path) -> None:
    """Refuse, in one sentence, a lock folder through which another user could make this
    user's GPU job open a file of theirs in place of a lock (and write its pid into it): a
    symbolic link of another user's, not a folder, owned by another user than this one or root
    (its owner may rename, delete and replace anything in it), or writable by others without
    the sticky bit (anyone may then replace this user's lock files). A link of root's or this
    user's (/tmp is one on some systems, and in many containers) is as safe as the folder it
    leads to. Inside a rootless container the host's /tmp shows as the overflow uid's: a
    sticky folder of that uid is root's there (`_host_owned`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UserError(f"The GPU lock folder {path} does not exist: ask root to make it, "
                        f"sticky and writable by all (`mkdir -m 1777 {path}`).") from None
    if stat.S_ISLNK(st.st_mode) and st.st_uid in (0, os.geteuid()):
        return check_lock_dir(path.resolve())
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "no folder"
        raise UserError(f"The GPU lock folder {path} is {kind}, "
                        f"through which another user could make a GPU job overwrite a file: ask "
                        f"root to replace it with a folder of root's, sticky and writable by all "
                        f"(`rm {path} && mkdir -m 1777 {path}`).")
    if st.st_uid not in (0, os.geteuid()):
        if not _host_owned(st):
            raise UserError(f"The GPU lock folder {path} belongs to user {_owner(st.st_uid)}, "
                            f"who could replace the lock files in it and make a GPU job of yours "
                            f"overwrite a file: ask root to give it to root, sticky and writable "
                            f"by all (`chown root: {path} && chmod 1777 {path}`).")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UserError(f"The GPU lock folder {path} is writable by other users but not sticky, "
                        f"so any of them could replace the lock files in it and make a GPU job "
                        f"overwrite a file: ask its owner ({_owner(st.st_uid)}) or root to run "
                        f"`chmod 1777 {path}`.")


def _open_lock(path: Path, wait_s: float = 2.0) -> tuple[int, bool]:
    """A descriptor of `path` open for writing, which a lock needs, and whether this user may
    write into it: created readable and writable by every user (os.open's mode is reduced by
    the umask, so it is set again), or opened as it is. What this user may not write, the
    folder or another user's file, is tried again for `wait_s` seconds (its maker sets the mode
    right after creating it: the two calls are not one step), then refused in one sentence.
    Never O_CREAT on a file that exists: with fs.protected_regular, Linux refuses that on
    another user's file in a sticky folder. Never through a symbolic link, and only a regular
    file (`_lock_file`)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            os.fchmod(fd, 0o666)
            return fd, True
        except (FileExistsError, PermissionError):
            pass  # someone's file, or a folder this user may not create in
        try:
            return _lock_file(path, os.open(path, os.O_RDWR | os.O_NOFOLLOW))
        except (FileNotFoundError, PermissionError) as e:
            if time.monotonic() >= deadline:
                blocked = path.parent if isinstance(e, FileNotFoundError) else path
                raise UserError(
                    f"The GPU lock {'folder' if blocked != path else 'file'} {blocked} is not "
                    f"writable for this user, so no GPU job of this user can claim that GPU: "
                    f"ask its owner or root to run `chmod {'1777' if blocked != path else '666'} "
                    f"{blocked}`.") from None
            time.sleep(0.05)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise UserError(f"The GPU lock file {path} is a symbolic link (made by "
                            f"{_owner(os.lstat(path).st_uid)}), which would make a GPU job "
                            f"overwrite the file it points to: ask its owner or root to remove "
                            f"it (`rm {path}`).") from None


def _lock_file(path: Path, fd: int) -> tuple[int, bool]:
    """`fd`, an existing lock file, if it is a regular file (not a FIFO or device another user
    put there), and whether this user may write its pid into it: only into a file of its own
    with no other name (a hard link would lead to a file elsewhere), never another's."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UserError(f"The GPU lock file {path} is no regular file (made by "
                        f"{_owner(st.st_uid)}): ask its owner or root to remove it "
                        f"(`rm {path}`).")
    return fd, st.st_uid == os.geteuid() and st.st_nlink == 1


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (not removed, nor replaced)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _try_lock(path: Path):
    """The open lock file at `path`, locked, or None when another process holds it.

    A lock counts only on the file that `path` names: a file removed between its opening and
    its locking (systemd-tmpfiles ageing /tmp, a user's `rm`) may have been replaced by a file
    another job locked meanwhile, so it is let go and the path tried again, and two jobs never
    hold one GPU through two files. The file written into is only one of this user's own, with
    the pid of the last of this user's jobs that held it: a job of another user that holds it
    leaves it as it was, so the file's text never says who holds the GPU (`lslocks` does)."""
    while True:
        fd, mine = _open_lock(path)
        f = os.fdopen(fd, "r+")
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EACCES, errno.EAGAIN):
                return None
            raise
        if _same_file(f.fileno(), path):
            break
        f.close()
    if mine:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    return f


def _keep_held() -> None:
    """One round of a job's guard over its locks (`_guard`): each held lock file made young
    (systemd-tmpfiles removes from /tmp only files whose times are all older than its age), and
    one no longer at its path (removed by hand) locked there again, so that the next claimer
    finds the GPU held. A claim between such a removal and this round is said in the log."""
    held = _held
    for i, (path, f) in enumerate(list(held)):
        if f.closed:
            continue
        try:
            os.utime(f.fileno())
            if _same_file(f.fileno(), path):
                continue
            again = _try_lock(path)
        except (OSError, UserError) as e:
            log.warning("The GPU lock file %s was removed while this job held its GPU, and "
                        "could not be made again (%s): another job may claim the GPU beside "
                        "this one.", path, e)
            continue
        if again is None:
            log.warning("The GPU lock file %s was removed while this job held its GPU, and "
                        "another job has claimed the GPU since: both now run on it (remove no "
                        "lock file of a running job).", path)
            continue
        held[i] = (path, again)
        f.close()


def _guard() -> None:
    """Keep this process's locks (`_keep_held`) while it holds any: a daemon thread."""
    while True:
        time.sleep(GUARD_S)
        if not any(not f.closed for _, f in _held):
            return
        _keep_held()


def started_by_srun() -> bool:
    """A rank that srun started among several tasks: Slurm chose its GPU."""
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def claim_gpus(count: int, what: str, entry: dict | None = None,
               poll_s: float = 2.0) -> list[dict]:
    """Claim `count` of the GPUs visible here for the rest of this process, waiting while too
    few are free; return them (name, memory_gb, uuid, and the seconds it waited) and make them
    this process's only CUDA devices. With a hardware `entry`, only GPUs of its model (and
    memory) where this machine has any, so that a job on a node of mixed GPUs runs on, and
    measures, the GPU it plans for. Nothing to claim without GPUs, for srun's ranks, or in a
    rank started by a process that already claimed."""
    inherited = os.environ.get(CLAIM_ENV)
    if inherited is not None:
        return json.loads(inherited)
    visible = hardware.visible_devices()
    if count < 1 or not visible or started_by_srun():
        return []
    gpus = [g for g in visible if entry and hardware.is_entry_gpu(entry, g)] or visible
    if count > len(gpus):
        raise UserError(f"{what} needs {count} GPUs but this machine shows {len(gpus)}: run it "
                        f"on a machine with {count}, or fix the entry's `gpus_per_node`.")
    waited, last_note = 0.0, -WAIT_LOG_S
    while True:
        held, busy = [], []
        for gpu in gpus:
            if len(held) == count:
                break
            path = lock_path(gpu["uuid"])
            lock = _try_lock(path)
            if lock is None:
                busy.append(path)
            else:
                held.append((gpu, path, lock))
        if len(held) == count:
            break
        for _, _, lock in held:
            lock.close()
        if waited - last_note >= WAIT_LOG_S:
            log.info("%s: waiting for %d free GPU(s); the others are claimed by running jobs "
                     "(their lock files: %s; `lslocks` names the processes holding them)", what,
                     count, ", ".join(map(str, busy)))
            last_note = waited
        time.sleep(poll_s)
        waited += poll_s
    _held.extend((path, lock) for _, path, lock in held)
    threading.Thread(target=_guard, name="imgclf-gpu-locks", daemon=True).start()
    claimed = [{**gpu, "waited_s": waited, "claimed_at": round(time.time(), 3)}
               for gpu, _, _ in held]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(g["uuid"] for g in claimed)
    os.environ[CLAIM_ENV] = json.dumps(claimed)
    log.info("%s: claimed GPU(s) %s", what, ", ".join(f"{g['name']} {g['uuid']}" for g in claimed))
    return claimed


def check_share(plan, what: str, processes: int = 1) -> dict:
    """What this job may use (hardware.job_limits: the CPUs and memory a scheduler confined it
    to) against what its loader plan assumes, said in the log; a plan whose `processes` (the
    ranks of a node, which share a job's memory) need more memory than the job may use is
    refused in one sentence, as the job would be killed partway. Returns the limits."""
    need = plan.host_bytes_per_process
    per_process = "" if need is None else f" and {need / hardware.GB:.2f} GB per process"
    limits = log_limits(what, f"; its loader plan ({plan.path}) assumes {plan.num_workers} "
                              f"worker(s){per_process}")
    memory = limits["memory_bytes"]
    if memory is not None and need is not None and need * processes > memory:
        raise UserError(f"{what} may use {memory / hardware.GB:.2f} GB of memory but its loader "
                        f"plan ({plan.path}) needs {need * processes / hardware.GB:.2f} GB: "
                        f"lower `loader.ram_margin` (at most {hardware.JOB_MEM_FRACTION}, the "
                        f"share of `clusters.{plan.cluster}.ram_gb` its jobs ask for) and rerun "
                        f"the memory solve, or ask your scheduler for more memory.")
    return limits


def log_limits(what: str, beside: str = "") -> dict:
    """Say in the log what stage `what` may use (hardware.job_limits), followed by `beside`
    (what it assumes of them), and return the limits: a job killed or slowed by its
    scheduler's limits is explained by its own log."""
    limits = hardware.job_limits()
    memory = limits["memory_bytes"]
    log.info("%s: this job may use %d CPU(s) and %s%s", what, limits["cpus"],
             "this machine's memory" if memory is None else f"{memory / hardware.GB:.2f} GB",
             beside)
    return limits


def claimed() -> list[dict] | None:
    """The GPUs this process (or the process that started it) claimed; None when none."""
    inherited = os.environ.get(CLAIM_ENV)
    return json.loads(inherited) if inherited else None


def claim_device(entry: dict, precision: str, what: str, count: int = 1):
    """The torch device stage `what` of hardware entry `entry` runs on, decided before its
    first CUDA call: `count` GPUs of a GPU entry claimed (claim_gpus), then the build, the
    driver (hardware.cuda_ready) and `precision` checked against them, a UserError naming the
    fix where they do not fit (cuda:0, the first claimed); Apple's MPS for an entry that uses
    it; the CPU for an entry of CPU ranks. None where a GPU entry finds no usable CUDA GPU
    here: each stage says what that means for it (run its plan on the CPU, or stop)."""
    import torch

    hardware.check_precision(entry, precision)  # the entry's GPU model, before any work
    if entry["accelerator"] == "mps":
        return torch.device("mps")
    if entry["accelerator"] != "gpu":
        return torch.device("cpu")
    claim_gpus(count, what, entry)
    if not hardware.cuda_ready(entry):
        return None
    hardware.check_precision(entry, precision, hardware.capability())  # the device decides
    return torch.device("cuda", 0)


# `model.precision` as Lightning trains it: the dtype autocast computes in, on any device
AUTOCAST_DTYPE = {"32": None, "16-mixed": "float16", "bf16-mixed": "bfloat16"}


def autocast_args(precision: str, device_type: str) -> dict:
    """torch.autocast's arguments for `precision` on `device_type` (disabled for "32")."""
    import torch

    dtype = AUTOCAST_DTYPE[precision]
    if dtype is None:
        return {"device_type": device_type, "enabled": False}
    return {"device_type": device_type, "dtype": getattr(torch, dtype)}


def autocast(precision: str, device_type: str):
    """The autocast region of `precision` on `device_type`."""
    import torch

    return torch.autocast(**autocast_args(precision, device_type))


def grad_scaler(precision: str, device_type: str):
    """The loss scaler of `precision` (16-mixed: float16 gradients underflow without one, on
    every device, as Lightning scales them), or None."""
    import torch

    return torch.amp.GradScaler(device_type) if precision == "16-mixed" else None
