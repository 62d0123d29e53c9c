"""Every figure of the pipeline, one module per stage, each drawn by a rule of its own
(workflow/rules/figures.smk) from the files its stage wrote: hydration, loader, memory, lr (the
LR summary's range tests), noise, lr_validation, batch, training (the curves), evaluation (the
confusion matrix or the most confused pairs); common holds what they share. No stage imports
them, so a figure's edit redraws that figure and reruns no compute job. Each module is a rerun
unit of its own: a rule lists the module it draws with, `figures.lr`, not the package."""
