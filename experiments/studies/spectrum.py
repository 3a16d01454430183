"""``zoo study spectrum``: is the context matrix P of a trained Transformer low rank? (Linformer Fig. 1)

Wang et al. 2020, "Linformer", arXiv:2006.04768, Sec. 3: P = softmax(Q W^Q (K W^K)^T / sqrt(d)) (eq. 2) for
every layer and head, on validation sequences; SVD of each P; the *normalised cumulative singular value*

    c_i = (sigma_1 + ... + sigma_i) / (sigma_1 + ... + sigma_n),   sigma_1 >= ... >= sigma_n,

averaged over sequences (Fig. 1 left: one curve per layer, here the mean over heads with the min-max band
over heads), and c_k per layer and head as a heatmap (Fig. 1 right: k = 128 of n = 512). The same for an
untrained model of the same shape (the control: what training adds). c_i reaches 1 at i = rank(P).

P comes from the run's own ``full`` cores (:meth:`attention_zoo.full.FullAttention.attention_probs`, the
``math`` backend's P) applied to the q, k each core received (captured by forward pre-hooks, see
``common``), in float64, one head at a time, over real tokens only (sequences with padding are skipped).

    zoo study spectrum --checkpoint runs/linformer_paper/mlm-n512/full/seed-0/checkpoints/last.ckpt \
        --out results/linformer_paper/spectrum-n512
    zoo study spectrum --replot results/linformer_paper/spectrum-n512 [--k 64]

Writes ``spectrum.csv`` (model, layer, head, index: mean and std of c_i over sequences), ``spectrum.json``
(what was run), ``fig1_left.png``, and for the heatmap's k ``spectrum_at_k<k>.csv`` and ``fig1_right_k<k>.png``
(``--replot DIR --k 32`` adds another k), the images also under ``tensorboard/``. Layers and heads are numbered
from 1, as in the paper's figure.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from jsonargparse import ArgumentParser, Namespace
from rich.console import Console
from rich.progress import Progress
from torch import Tensor

from attention_zoo import MultiHeadAttention
from attention_zoo.full import FullAttention
from experiments.studies.cli import add_output_options, run_study, study_parser
from experiments.studies.common import (
    TrainedRun,
    UnreadableRecord,
    capture,
    full_length_batches,
    load_data_module,
    load_run,
    number,
    pyplot,
    read_csv,
    read_json,
    repo_path,
    save_figure,
    write_csv,
)

CURVE_COLUMNS = ["model", "layer", "head", "index", "mean", "std", "sequences"]
AT_K_COLUMNS = ["model", "layer", "head", "k", "mean", "std", "sequences"]
MODELS = ("trained", "random init")
DEFAULT_K = 128


def normalized_cumulative(singular_values: Tensor) -> Tensor:
    """c_i = sum_{j <= i} sigma_j / sum_j sigma_j along the last axis (values in descending order)."""
    total = singular_values.cumsum(-1)
    return total / total[..., -1:].clamp(min=torch.finfo(total.dtype).tiny)


def context_spectrum(core: FullAttention, q: Tensor, k: Tensor, real: Tensor | None) -> Tensor:
    """Normalised cumulative singular values of P for each head of one sequence: ``q, k`` (1, H, N, D),
    ``real`` (N,) bool or None; returns (H, L) float64, L = number of real tokens. One P at a time."""
    keep = slice(None) if real is None else real
    curves = []
    for head in range(q.shape[1]):
        qh, kh = (t[:, head : head + 1, keep].double() for t in (q, k))
        probs = core.attention_probs(qh, kh)[0, 0]  # (L, L): real queries over real keys
        curves.append(normalized_cumulative(torch.linalg.svdvals(probs)))
    return torch.stack(curves)


class Moments:
    """Running mean and standard deviation of same-shaped tensors (float64)."""

    def __init__(self) -> None:
        self.count, self.total, self.squares = 0, None, None

    def add(self, value: Tensor) -> None:
        value = value.double()
        self.total = value.clone() if self.total is None else self.total + value
        self.squares = value**2 if self.squares is None else self.squares + value**2
        self.count += 1

    def mean_std(self) -> tuple[Tensor, Tensor]:
        mean = self.total / self.count
        var = (self.squares / self.count - mean**2).clamp(min=0) * (self.count / max(1, self.count - 1))
        return mean, var.sqrt()


def measure(runs: dict[str, TrainedRun], data, sequences: int, out) -> dict[str, Moments]:
    """Per model: moments over sequences of the (layers, heads, N) normalised cumulative singular values."""
    n = next(iter(runs.values())).max_seq_len
    moments = {name: Moments() for name in runs}
    cores = {}
    for name, run in runs.items():
        cores[name] = [block.core for block in run.encoder.modules() if isinstance(block, MultiHeadAttention)]
        if not all(isinstance(core, FullAttention) for core in cores[name]):
            raise ValueError(
                f"{run.checkpoint} was trained with attention {run.attention!r}; the spectrum of P needs a model "
                "with full softmax attention (a 'full' run)"
            )
    with Progress(console=out) as progress:
        task = progress.add_task(f"spectrum of P, n={n}", total=sequences)
        for tokens, mask in full_length_batches(data, sequences, n):
            for name, run in runs.items():
                layers = capture(run, tokens, mask)
                for b in range(tokens.shape[0]):
                    stacked = torch.stack(
                        [
                            context_spectrum(core, inputs.q[b : b + 1], inputs.k[b : b + 1], mask[b])
                            for core, inputs in zip(cores[name], layers, strict=True)
                        ]
                    )  # (layers, heads, N)
                    moments[name].add(stacked)
            progress.advance(task, tokens.shape[0])
    if moments[next(iter(moments))].count == 0:
        raise ValueError(f"no validation sequence of {n} real tokens: the validation split is too short")
    return moments


def curve_rows(moments: dict[str, Moments]) -> list[dict[str, object]]:
    rows = []
    for name, moment in moments.items():
        mean, std = moment.mean_std()
        layers, heads, length = mean.shape
        for layer in range(layers):
            for head in range(heads):
                for index in range(length):
                    rows.append(
                        {
                            "model": name,
                            "layer": layer + 1,
                            "head": head + 1,
                            "index": index + 1,
                            "mean": f"{mean[layer, head, index].item():.6g}",
                            "std": f"{std[layer, head, index].item():.3g}",
                            "sequences": moment.count,
                        }
                    )
    return rows


def at_k(rows: list[dict[str, str]], k: int) -> list[dict[str, object]]:
    """The rows of index k (the heatmap); k beyond N takes the last index."""
    length = max(int(r["index"]) for r in rows)
    index = min(k, length)
    return [{**r, "k": index} for r in rows if int(r["index"]) == index]


def _check_complete(rows: list[dict[str, str]], path: Path) -> None:
    """Both models of ``MODELS`` (the study measures both), each with one row per layer, head and index: a file cut
    at a line end passes the reader, not this."""
    models = {r["model"] for r in rows}
    if models != set(MODELS):
        raise UnreadableRecord(
            f"{path}: rows of model(s) {', '.join(sorted(models))}; a spectrum has rows of {' and '.join(MODELS)}"
        )
    keys = {(r["model"], int(r["layer"]), int(r["head"]), int(r["index"])) for r in rows}
    shape = [len({key[i] for key in keys}) for i in range(4)]
    if len(rows) != len(keys) or len(keys) != shape[0] * shape[1] * shape[2] * shape[3]:
        raise UnreadableRecord(
            f"{path}: {len(rows)} rows, a spectrum of {shape[0]} model(s) x {shape[1]} layers x {shape[2]} heads x "
            f"{shape[3]} indices has {shape[0] * shape[1] * shape[2] * shape[3]}, each once: a truncated file"
        )


def plot(directory: Path, k: int) -> list[Path]:
    """``fig1_left.png`` and ``fig1_right_k<k>.png`` (with ``spectrum_at_k<k>.csv``) from ``spectrum.csv``."""
    path = directory / "spectrum.csv"
    rows = read_csv(path, CURVE_COLUMNS, what="the folder of a zoo study spectrum",
                    integers=("layer", "head", "index"), numbers=("mean",))  # fmt: skip
    _check_complete(rows, path)
    write_csv(directory / f"spectrum_at_k{k}.csv", at_k(rows, k), AT_K_COLUMNS)
    plt = pyplot()
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    layers = sorted({int(r["layer"]) for r in rows})
    heads = sorted({int(r["head"]) for r in rows})
    length = max(int(r["index"]) for r in rows)
    table: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        table.setdefault((r["model"], int(r["layer"]), int(r["head"])), [0.0] * length)[int(r["index"]) - 1] = number(
            r["mean"]
        )
    tensorboard = directory / "tensorboard"

    figure, axes = plt.subplots(
        1, len(models), figsize=(5.5 * len(models), 4.2), sharey=True, squeeze=False, layout="constrained"
    )
    colors = plt.cm.viridis([i / max(1, len(layers) - 1) for i in range(len(layers))])
    x = range(1, length + 1)
    for ax, model in zip(axes[0], models, strict=True):
        for color, layer in zip(colors, layers, strict=True):
            curves = torch.tensor([table[(model, layer, h)] for h in heads])
            ax.plot(x, curves.mean(0), color=color, label=f"layer {layer}")
            ax.fill_between(x, curves.min(0).values, curves.max(0).values, color=color, alpha=0.2)
        ax.axvline(min(k, length), color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{model} (n = {length})")
        ax.set_xlabel("singular value index")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("normalised cumulative singular value")
    axes[0][0].legend(loc="lower right", fontsize=8)
    figure.suptitle("Spectrum of P: mean over heads (band: min-max over heads)")
    written = [save_figure(figure, directory / "fig1_left.png", tensorboard)]

    size = (0.9 * len(heads) * len(models) + 3, 0.7 * len(layers) + 2)
    figure, axes = plt.subplots(1, len(models), figsize=size, layout="constrained")
    axes = [axes] if len(models) == 1 else list(axes)
    index = min(k, length) - 1
    for ax, model in zip(axes, models, strict=True):
        grid = [[table[(model, layer, h)][index] for h in heads] for layer in reversed(layers)]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, values in enumerate(grid):
            for j, value in enumerate(values):
                ax.text(
                    j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color="white" if value < 0.6 else "k"
                )
        ax.set_xticks(range(len(heads)), [str(h) for h in heads])
        ax.set_yticks(range(len(layers)), [str(layer) for layer in reversed(layers)])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{model}: c at index {index + 1}")
    figure.colorbar(image, ax=axes, shrink=0.8)
    written.append(save_figure(figure, directory / f"fig1_right_k{k}.png", tensorboard))
    return written


#: zoo study spectrum --help's examples
EXAMPLES = (
    "zoo study spectrum --checkpoint runs/linformer_paper/mlm-n512/full/seed-0/checkpoints/last.ckpt --out DIR",
    "zoo study spectrum --replot results/linformer_paper/spectrum-n512 --k 64",
)


def build_parser() -> ArgumentParser:
    parser = study_parser("zoo study spectrum", __doc__, EXAMPLES)
    parser.add_argument("--checkpoint", type=str | None, default=None, help="a full-attention run's last.ckpt")
    parser.add_argument("--config", type=str | None, default=None, help="its config.yaml (default: next to the run)")
    parser.add_argument("--sequences", type=int, default=64, help="validation sequences (paper: 10k sentences)")
    parser.add_argument(
        "--k", type=int | None, default=None, help="index of the heatmap (default 128, the paper's for n = 512)"
    )
    parser.add_argument("--control-seed", type=int, default=0, help="seed of the randomly initialised control")
    return add_output_options(parser, out="runs/studies/spectrum")


def main(argv: list[str]) -> int:
    return run_study(build_parser(), argv, check=_check_sizes, replot=_replot, run=_run)


def _check_sizes(args: Namespace) -> str | None:
    if (args.k is not None and args.k < 1) or args.sequences < 1:
        return f"--k and --sequences must be >= 1, got k={args.k}, sequences={args.sequences}"
    return None


def _replot(directory: Path, args: Namespace) -> list[Path]:
    saved = directory / "spectrum.json"
    k = read_json(saved, "the folder of a zoo study spectrum").get("k", DEFAULT_K) if saved.is_file() else DEFAULT_K
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UnreadableRecord(f"{saved}: k {k!r} is not an int >= 1")
    return plot(directory, args.k or k)


def _run(parser: ArgumentParser, args: Namespace, out: Console) -> int:
    if not args.checkpoint:
        parser.error("give --checkpoint (or --replot DIR)")
    trained = load_run(Path(args.checkpoint), args.config and Path(args.config))
    control = load_run(Path(args.checkpoint), args.config and Path(args.config), random_init_seed=args.control_seed)
    data = load_data_module(trained)
    with torch.no_grad():
        moments = measure({"trained": trained, "random init": control}, data, args.sequences, out)
    directory = Path(args.out)
    write_csv(directory / "spectrum.csv", curve_rows(moments), CURVE_COLUMNS)
    meta = {
        "checkpoint": repo_path(trained.checkpoint),
        "config": repo_path(trained.config),
        "attention": trained.attention,
        "n": trained.max_seq_len,
        "layers": int(trained.hparams["depth"]),
        "heads": int(trained.hparams["heads"]),
        "sequences": moments["trained"].count,
        "k": args.k or DEFAULT_K,
        "control_seed": args.control_seed,
    }
    (directory / "spectrum.json").write_text(json.dumps(meta, indent=2) + "\n")
    written = plot(directory, meta["k"])
    out.print(
        f"{meta['sequences']} sequences of n = {meta['n']}; wrote {directory}/spectrum.csv, "
        + ", ".join(p.name for p in written)
    )
    return 0
