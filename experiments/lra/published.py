"""Published Long Range Arena accuracies (%), quoted beside the suite's own table, each with its source.

- LRA Table 1: Tay et al. 2020, "Long Range Arena: A Benchmark for Efficient Transformers", arXiv:2011.04006,
  Table 1; the same numbers as the leaderboard in the authors' repository README (github.com/google-research/
  long-range-arena, "as of 8th November 2020"), checked there. The models are the LRA repository's base
  configs (larger than the zoo's reference scale); Path-X is FAIL for every model and the average is over
  the other five tasks.
- Nystromformer Table 3: Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for Approximating
  Self-Attention", arXiv:2102.03902, Table 3, "Results on Long Range Arena (LRA) benchmark using our PyTorch
  implementation" (github.com/mlpen/Nystromformer, LRA/code: 2 layers, dim 64, 2 heads of 32, FFN 128), checked
  in the paper's ar5iv rendering. This is the setting the zoo's reference scale follows.

Only numbers found in those sources are quoted; the zoo mechanism each published row corresponds to is named
in :data:`ZOO_NAMES` (a row without a zoo counterpart is still shown, unmatched).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the LRA task columns, in the order the published tables give them
TASKS = ("listops", "text", "retrieval", "image", "pathfinder")


@dataclass(frozen=True)
class PublishedTable:
    """A published table: its title, citation, where the numbers were checked, which scale its models are
    (``reference`` where the zoo's reference scale follows its model and schedule, else ``other``) and its rows,
    ``{model: (listops, text, retrieval, image, pathfinder, average)}`` in % accuracy."""

    title: str
    citation: str
    checked_in: str
    setting: str
    rows: dict[str, tuple[float, float, float, float, float, float]]


LRA_TABLE_1 = PublishedTable(
    title="LRA Table 1",
    citation="Tay et al. 2020, arXiv:2011.04006, Table 1",
    checked_in="github.com/google-research/long-range-arena README (leaderboard as of 8 November 2020)",
    setting="other",
    rows={
        "Local Att": (15.82, 52.98, 53.39, 41.46, 66.63, 46.06),
        "Linear Trans.": (16.13, 65.90, 53.09, 42.34, 75.30, 50.55),
        "Reformer": (37.27, 56.10, 53.40, 38.07, 68.50, 50.67),
        "Sparse Trans.": (17.07, 63.58, 59.59, 44.24, 71.71, 51.24),
        "Sinkhorn Trans.": (33.67, 61.20, 53.83, 41.23, 67.45, 51.29),  # as published: its five cells average 51.48
        "Linformer": (35.70, 53.94, 52.27, 38.56, 76.34, 51.36),
        "Performer": (18.01, 65.40, 53.82, 42.77, 77.05, 51.41),
        "Synthesizer": (36.99, 61.68, 54.67, 41.61, 69.45, 52.88),
        "Longformer": (35.63, 62.85, 56.89, 42.22, 69.71, 53.46),
        "Transformer": (36.37, 64.27, 57.46, 42.44, 71.40, 54.39),
        "BigBird": (36.05, 64.02, 59.29, 40.83, 74.87, 55.01),
    },
)

NYSTROMFORMER_TABLE_3 = PublishedTable(
    title="Nystromformer Table 3",
    citation="Xiong et al. 2021, arXiv:2102.03902, Table 3 (their PyTorch LRA reimplementation)",
    checked_in="arXiv:2102.03902 (ar5iv rendering), Table 3",
    setting="reference",
    rows={
        "Standard": (37.10, 65.02, 79.35, 38.20, 74.16, 58.77),
        "Reformer": (19.05, 64.88, 78.64, 43.29, 69.36, 55.04),
        "Linformer": (37.25, 55.91, 79.37, 37.84, 67.60, 55.59),
        "Performer": (18.80, 63.81, 78.62, 37.07, 69.87, 53.63),
        "Nyströmformer": (37.15, 65.52, 79.56, 41.58, 70.94, 58.95),
    },
)

TABLES = (LRA_TABLE_1, NYSTROMFORMER_TABLE_3)

#: published model -> the zoo mechanism that implements it (Reformer's attention is LSH attention)
ZOO_NAMES = {
    "Transformer": "full",
    "Standard": "full",
    "Local Att": "local",
    "Linear Trans.": "linear",
    "Reformer": "lsh",
    "Sparse Trans.": "sparse",
    "Linformer": "linformer",
    "Performer": "performer",
    "Longformer": "longformer",
    "BigBird": "bigbird",
    "Nyströmformer": "nystrom",
}


def scale_note(table: PublishedTable, scale: str) -> str:
    """How the suite's numbers at ``scale`` relate to ``table``'s: ``other scale`` for the lite suite against any
    published table; at the reference scale, the same setting only for the table whose model it follows."""
    if scale != "reference":
        return "other scale: published at LRA's lengths and models; the lite suite's numbers are not comparable"
    if table.setting == "reference":
        return "same setting: the reference scale follows this table's model, schedule and budgets"
    return "other model: LRA's base configs are larger than the reference scale's 2 x 64 model"
