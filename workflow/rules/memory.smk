# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule solve_memory:
    """Largest per-device batch under the safety margin, accumulation to the recipe's global
    batch, loader workers/prefetch within the host RAM budget."""
    input:
        loader=layout.loader("{cluster}"),
        code=code("memory", *DATA_PIPELINE, "devices", *STARTS_FROM_WEIGHTS),
    output:
        json=report(
            layout.memory("{cluster}"),
            caption="../report/memory.rst",
            category="3. Memory",
        ),
    log:
        "logs/memory/{cluster}.log",
    benchmark:
        "logs/benchmarks/memory/{cluster}.tsv"
    threads: memory_cpus
    resources:
        **device_job(memory_cpus, memory_gpus),
    params:
        p=lambda wc: slices.memory_params(config, wc.cluster),
    script:
        "../scripts/solve_memory.py"
