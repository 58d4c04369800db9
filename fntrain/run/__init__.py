"""The run as a transaction, its files in the order a run happens.

    config.py      the shared job config (`JobConfig`, `TrainConfig`, `LoaderConfig`) and `RecipeSpec`
    checks.py      phase 1: everything knowable before touching disk (values, launcher, inputs, packages)
    resume.py      the resume source, decided once: a verified checkpoint path or nothing
    open.py        phase 2 begins: the run directory, logs and metadata, undone if no step ran
    build.py       model, assets, datasets, plan, optimizer, schedule, step and hooks
    finish.py      export, the summary line, the recorded outcome
    job.py         `run_job` and `plan_job`, reading top to bottom

Beside them: directory.py (one run per directory), metadata.py (run_metadata.json), logs.py
(per-rank logs), report.py (the start-of-run lines), config_file.py (--config files), recipes.py
(finding recipes by name), plot.py (plots of a finished run).

Importing this package imports nothing heavy: the CLI reads config files without torch.
"""
