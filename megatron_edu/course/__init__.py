"""The course around the core: what teaches the parallelism, not the parallelism itself.

exercises/       every exercise's checker: ``check(exercise_id, fn)`` answers ✓ or a hint in words
viz/             the notebooks' pictures and explorers (they draw; computations live in the core
                 and in ``perf``)
student.py       the student notebooks: every solution replaced by a stub (make student-notebooks)
ln_placement.py  the layer-norm experiment behind notebook 11's Figure 7 curves

The core (launch, grid, comm, tensor_parallel, model, pipeline, data_parallel, optim, ptdp) never
imports this package (tests/test_packaging.py checks it); exercises plug into the core through
its parameters (e.g. ``run_schedule(..., RunSettings(messages=...))``), never by patching it.
"""
