"""DDP training with Lightning, resumable after a crash (`imgclf train`): the stage's entry point
is runner.py (`run`); module.py holds the model, data and LR schedule, callbacks.py and
wiring.py what each attempt records, resume.py the resume decision, summary.py what follows
the training."""
