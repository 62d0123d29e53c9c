"""The optional batch curve (workflow/rules/batch.smk): the runs' shapes, budgets and targets
(grid), the range test at each batch (range_test) and the curve fitted to the runs (curve).
Each module is a rerun unit of its own: a rule lists the modules it runs, `batch.grid`, not the
package."""
