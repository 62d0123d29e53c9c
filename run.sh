#!/usr/bin/env bash
# Set up .venv from this platform's lock (first use, or after pyproject.toml or the lock
# changed) and run the pipeline or the tests.
#   ./run.sh demo [snakemake args...]   the whole workflow on the bundled demo data set
#   ./run.sh test [pytest args...]      the test suite
#   ./run.sh setup                      only set up .venv
#   ./run.sh lock [--upgrade]           make requirements/'s locks again (after pyproject.toml)
set -euo pipefail
cd "$(dirname "$0")"
# Ctrl-C ends the set-up. pip and compileall catch it and exit 1, which the retries below and
# the skipped files would otherwise read as a failure to go on from.
trap 'exit 130' INT

# pip install into .venv, tried again after a pause when the network drops a download: pip gives
# up on a wheel after a few quick resumes, and torch's CUDA wheels are large. Bytecode is
# compiled after the installs, on every core (compile_bytecode), not by pip on one.
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        .venv/bin/python -m pip install --quiet --no-compile "$@" && return 0
        [ "$attempt" = 3 ] && break
        echo "run.sh: pip install failed (attempt $attempt of 3); trying again in $((60 * attempt)) s" >&2
        sleep $((60 * attempt))
    done
    echo "run.sh: pip install failed 3 times; check the network and run the same command again" >&2
    return 1
}

# Snakemake 9 and the package (pyproject.toml's requires-python) need Python 3.11
check_python() {
    if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "run.sh: python3 is $(python3 -V 2>&1 | cut -d' ' -f2), and Snakemake 9 and this package need Python 3.11 or newer: put a newer python3 first on PATH (for example with pyenv or your cluster's module system)." >&2
        exit 1
    fi
}

setup() {
    check_python
    # .venv's interpreter lies in this folder, and Snakemake runs its scripts with that path
    # unquoted (snakemake#2645): refuse a path a shell would split before installing anything
    if ! python3 -c 'import shlex, sys; sys.exit(shlex.quote(sys.argv[1]) != sys.argv[1])' "$PWD"; then
        echo "run.sh: this checkout's path '$PWD' has a space or a shell character, which Snakemake cannot run scripts from (it does not quote the interpreter's path, snakemake#2645): clone or move it to a path without them." >&2
        exit 1
    fi
    # this platform's lock (requirements/, made by `./run.sh lock`; src/imgclf/lock.py)
    lock=$(PYTHONPATH=src python3 -m imgclf.lock path)
    if [ ! -x .venv/bin/snakemake ] || [ pyproject.toml -nt .venv/.installed ] ||
        { [ -n "$lock" ] && [ "$lock" -nt .venv/.installed ]; }; then
        rm -f .venv/.installed
        python3 -m venv .venv
        pip_install --upgrade pip
        # PyTorch's own wheel index when this node's GPUs or NVIDIA driver need another CUDA
        # build than the default one (src/imgclf/cuda_builds.py; IMGCLF_TORCH_INDEX overrides)
        index=$(PYTHONPATH=src python3 -m imgclf.cuda_builds)
        installed_from=/dev/null
        if [ -n "$index" ]; then
            # that index's builds are not in the locks: the newest releases pyproject.toml allows
            echo "run.sh: torch from $index, and the other packages unlocked (the locks hold the default build)" >&2
            pip_install --index-url "$index" torch torchvision
            pip_install -e '.[test]'
        elif [ -n "$lock" ]; then
            # every package at the lock's version, each file checked against its hashes
            pip_install --require-hashes --no-deps -r "$lock"
            pip_install --no-deps -e .
            installed_from=$lock
        else
            echo "run.sh: no lock for $(uname -s) $(uname -m) in requirements/: installing the newest releases pyproject.toml allows" >&2
            pip_install -e '.[test]'
        fi
        compile_bytecode
        cp "$installed_from" .venv/installed-lock.txt # what provenance names the environment by
        touch .venv/.installed
    fi
}

# Bytecode of every installed module, compiled on the cores this process may use (a login
# node's or a Slurm job's share, not the machine's count): pip compiles on one, as it
# installs (docs/benchmarks.md, "Set-up from the lock"). Compiled here rather than on first
# import, so that a .venv that other users run without write access starts as fast for them. A
# file that does not compile (a package's test data) is skipped, as pip skips it.
compile_bytecode() {
    local cores site
    cores=$(.venv/bin/python -c 'from imgclf.hardware import usable_cpus; print(usable_cpus())')
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    .venv/bin/python -m compileall -q -j "$cores" "$site" > /dev/null || true
}

# Make the locks again (requirements/, one per platform) after pyproject.toml's dependencies or
# requirements/ceiling.txt changed, with uv in a throw-away environment: versions already locked
# are kept where they still fit; `./run.sh lock --upgrade` takes the newest that fit.
make_locks() {
    local tool uv_platform python lock
    check_python
    tool=$(mktemp -d)
    python3 -m venv "$tool"
    "$tool/bin/python" -m pip install --quiet 'uv>=0.13'
    while read -r uv_platform python lock; do
        # macOS: uv assumes macOS 13 unless told; torch's macOS wheels need 14
        MACOSX_DEPLOYMENT_TARGET=14.0 "$tool/bin/uv" pip compile --quiet pyproject.toml \
            --extra test --generate-hashes --python-version "$python" --python-platform "$uv_platform" \
            --constraint requirements/ceiling.txt --custom-compile-command "./run.sh lock" \
            --output-file "$lock" "$@"
        { PYTHONPATH=src python3 -m imgclf.lock header; grep -v '^# made from ' "$lock"; } > "$lock.new"
        mv "$lock.new" "$lock"
        echo "run.sh: $lock made"
    done < <(PYTHONPATH=src python3 -m imgclf.lock targets)
    rm -rf "$tool"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    demo) setup; exec .venv/bin/snakemake --cores all "$@" ;;
    # two pytest-xdist workers, each test file's tests on one of them (a file's shared runs are
    # built once), the files in tests/conftest.py's order; a later -n replaces the 2 (-n 0: one
    # process)
    test) setup; exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@" ;;
    setup) setup ;;
    lock) make_locks "$@" ;;
    *) echo "usage: ./run.sh demo|test [args...], ./run.sh setup or ./run.sh lock [--upgrade]" >&2; exit 2 ;;
esac
