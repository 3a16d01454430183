"""``zoo study <name>``: the source papers' claims, checked with this project's own code.

    zoo study spectrum --checkpoint CKPT      # Linformer Fig. 1: spectrum of P, trained vs random init
    zoo study approx                          # Theorems 1-2 and the Nystromformer claim: error vs budget and n
    zoo study mlm                             # Linformer Fig. 3 / Table 2: MLM perplexity vs k, n, sharing
    zoo study <name> --replot DIR             # redraw a study's figures from its committed CSVs

Each study writes CSVs first and draws its figures from them; ``zoo study <name> --help`` gives its options.
"""

from __future__ import annotations

import importlib
import sys

#: study -> (module, one-line help)
STUDIES: dict[str, tuple[str, str]] = {
    "spectrum": ("experiments.studies.spectrum", "normalised cumulative singular values of P per layer and head"),
    "approx": ("experiments.studies.approx", "relative error of each approximation vs softmax attention"),
    "mlm": ("experiments.studies.mlm", "MLM validation perplexity curves and final table of the Linformer runs"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: zoo study <name> [args]\n\nstudies:")
        for name, (_, text) in STUDIES.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in STUDIES:
        print(f"zoo study: unknown study {name!r}; choose from {', '.join(STUDIES)}", file=sys.stderr)
        return 2
    return importlib.import_module(STUDIES[name][0]).main(rest) or 0
