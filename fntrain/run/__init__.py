"""The run as a transaction, its files in the order a run happens.

    config.py      the shared job config (`JobConfig`, `TrainConfig`) and `RecipeSpec`
    checks.py      phase 1: everything knowable before touching disk (values, launcher, inputs, packages)
    launch.py      what this launch is, decided once: fresh, resume (a checkpoint and the setting changes
                   it brings), overwrite (the old run moved aside) or complete; verified in phase 2
    open.py        phase 2 begins: the run directory, logs and metadata, undone if no step ran
    build.py       model, assets, datasets, plan, optimizer, schedule, step and hooks
    finish.py      export, the summary line, the recorded outcome
    job.py         `run_job` and `plan_job`, reading top to bottom

Beside them: directory.py (one run per directory), metadata.py (run_metadata.json), logs.py
(per-rank logs), report.py (the start-of-run lines), resolved.py (config.json and the recipe reference
a run records), recipe_of.py (a checkpoint of another recipe, refused by name). Config files, recipe lookup, plots and the config docs are the CLI's (`fntrain.cli`).

Importing this package imports nothing heavy: the CLI reads config files without torch.
"""
