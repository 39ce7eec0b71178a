"""The run history: every added run's comparability keys and headline figures in one DuckDB
file, trends per series, and the trend gate.

- `record.read_run(run_dir) -> HistoryRun`: what the history keeps of a run (read with
  `slo.runrecord`), keyed by `SeriesKey` (workload hash, engine and version, model, hardware).
- `store.HistoryStore(path)`: the database (`schema` holds its versions and migrations);
  `add`, `runs`; several processes may add at once.
- `changepoint.e_divisive`: E-divisive means change points; `trend.find_shifts` keeps those
  that matter, `trend.trend_gate` judges a new run against the recent comparable runs.
- `trend_card`: a metric's trend as data and the self-contained HTML trend card.
- `cli`: `bench history add | list | show | report | gate`.
"""
