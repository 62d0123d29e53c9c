#!/usr/bin/env bash
# Set up .venv (first use, or after pyproject.toml changed) and run the pipeline or the tests.
#   ./run.sh demo [snakemake args...]   the whole workflow on the bundled demo data set
#   ./run.sh test [pytest args...]      the test suite
#   ./run.sh setup                      only set up .venv
set -euo pipefail
cd "$(dirname "$0")"

# pip install into .venv, tried again after a pause when the network drops a download: pip gives
# up on a wheel after a few quick resumes, and torch's CUDA wheels are large.
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        .venv/bin/python -m pip install --quiet "$@" && return 0
        [ "$attempt" = 3 ] && break
        echo "run.sh: pip install failed (attempt $attempt of 3); trying again in $((60 * attempt)) s" >&2
        sleep $((60 * attempt))
    done
    echo "run.sh: pip install failed 3 times; check the network and run the same command again" >&2
    return 1
}

setup() {
    # .venv's interpreter lies in this folder, and Snakemake runs its scripts with that path
    # unquoted (snakemake#2645): refuse a path a shell would split before installing anything
    if ! python3 -c 'import shlex, sys; sys.exit(shlex.quote(sys.argv[1]) != sys.argv[1])' "$PWD"; then
        echo "run.sh: this checkout's path '$PWD' has a space or a shell character, which Snakemake cannot run scripts from (it does not quote the interpreter's path, snakemake#2645): clone or move it to a path without them." >&2
        exit 1
    fi
    if [ ! -x .venv/bin/snakemake ] || [ pyproject.toml -nt .venv/.installed ]; then
        python3 -m venv .venv
        pip_install --upgrade pip
        # PyTorch's own wheel index when this node's GPUs or NVIDIA driver need another CUDA
        # build than the default one (src/imgclf/cuda_builds.py; IMGCLF_TORCH_INDEX overrides)
        index=$(PYTHONPATH=src python3 -m imgclf.cuda_builds)
        if [ -n "$index" ]; then
            pip_install --index-url "$index" torch torchvision
        fi
        pip_install -e '.[test]'
        touch .venv/.installed
    fi
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
    *) echo "usage: ./run.sh demo|test [args...] or ./run.sh setup" >&2; exit 2 ;;
esac
