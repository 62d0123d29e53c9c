"""The forecast before training: the timing model (timing.py), the CPU ranks timed here
(cpu_ranks.py), and the bill the stage writes (report.py)."""
