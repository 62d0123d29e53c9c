"""The LR stage (workflow/rules/lr.smk and validate.smk): the range tests (find), their
summary and the chosen LR (summary), its scaling to the global batch (scaling), the LR
validation's grid (grid) and its runs ranked, extended and aggregated (validation). Each module
is a rerun unit of its own: a rule lists the modules it runs, `lr.find`, not the package."""
