"""The targets table of each round of a multi-round `zoo targets` sweep (the r-th row of each case), then the
sweep's own table (each case's fastest round).

    cd results/cpu_targets/sweep_rounds && COLUMNS=250 python per_round.py . > targets.txt
"""

import sys

from rich.console import Console

from experiments.bench import targets
from experiments.bench.store import ResultStore, case_of

store = ResultStore(sys.argv[1])
by_key: dict[str, list[dict]] = {}
for row in store.rows:
    by_key.setdefault(case_of(row).key(), []).append(row)
console = Console(width=250)
for r in range(max(len(rows) for rows in by_key.values())):
    console.print(f"round {r + 1}")
    console.print(targets.targets_table({k: rows[r] for k, rows in by_key.items() if len(rows) > r}, None, 1))
console.print("fastest round of each case")
console.print(targets.targets_table(store.best(), None, 1))
