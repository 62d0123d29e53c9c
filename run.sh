#!/usr/bin/env bash
# Set up .venv (first use, or after pyproject.toml changed) and run the pipeline or the tests.
#   ./run.sh demo [snakemake args...]   the whole workflow on the bundled demo data set
#   ./run.sh test [pytest args...]      the test suite
set -euo pipefail
cd "$(dirname "$0")"

setup() {
    if [ ! -x .venv/bin/snakemake ] || [ pyproject.toml -nt .venv/.installed ]; then
        python3 -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet -e '.[test]'
        touch .venv/.installed
    fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
    demo) setup; exec .venv/bin/snakemake --cores all "$@" ;;
    test) setup; exec .venv/bin/python -m pytest "$@" ;;
    *) echo "usage: ./run.sh demo|test [args...]" >&2; exit 2 ;;
esac
