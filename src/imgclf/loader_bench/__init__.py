"""The loader benchmark: how fast the training input pipeline feeds one device, and at what RAM
cost. Its entry point is bench.py (`run`); timing.py times one configuration, choice.py picks
the configuration the training uses."""
