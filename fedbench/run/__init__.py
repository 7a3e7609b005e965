"""One run, in four parts (what `fedbench.runner.Run` is made of; import from there):

- `build` (fedbench/run/build.py): from the checked config (`RunConfig`) to the parts a run
  trains with (`Built`: device, data and partition, federation, model factory, engine,
  attack, algorithm, client sampler); writes nothing.
- `loop` (fedbench/run/loop.py): `Run`, the run's life: claim the directory, the round loop
  (sample, train, evaluate when due, checkpoint when due), signals (`Interrupted`), run.log
  and error.txt.
- `checkpoint` (fedbench/run/checkpoint.py): checkpoint.pt as the loop uses it: save the
  run's state with the loop's progress, restore it on resume, which rows a resume keeps.
  The file format and the checks that admit a resume are fedbench/checkpoint.py's.
- `record` (fedbench/run/record.py): partition.json, metrics.csv and clients.csv rows, the
  final / best trackers (`Progress`), summary.json with its objective, the final table.

The loop imports the other three; record imports build (its `Built`), checkpoint imports
record (its `Progress`); none imports the loop.
"""
