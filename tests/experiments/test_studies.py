"""``zoo study spectrum | approx | mlm`` on tiny inputs: each writes its files and redraws its figures from its
CSVs; the quantities they rest on are checked against definitions that do not come from the study's code
(ranks of constructed matrices, ``torch.linalg.svd``, the Eckart-Young-Mirsky theorem, exact limits)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.tensorboard import SummaryWriter

from experiments import cli
from experiments.studies import approx_methods as am
from experiments.studies.common import AttentionInputs, capture, load_run
from experiments.studies.spectrum import context_spectrum, normalized_cumulative
from tasks.token_prediction import TokenPrediction

N = 32  # tiny sequence length of every fixture


@pytest.fixture(autouse=True)
def no_global_state_left(one_thread_and_private_cache):
    yield
    assert torch.is_grad_enabled()  # the studies leave no global state behind for the tests that follow


def write_run(folder: Path, attention: str = "full", options: dict | None = None, seed: int = 0) -> Path:
    """A run folder as ``zoo fit`` leaves it (``checkpoints/last.ckpt`` with hyperparameters and weights, and
    ``config.yaml`` with the data section), for a tiny MLM model with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    task = TokenPrediction(260, N, 260, attention=attention, attention_options=options or {}, dim=16, depth=2, heads=2)
    hparams = dict(task.hparams) | {"_class_path": "tasks.token_prediction.TokenPrediction"}
    checkpoint = folder / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": hparams}, checkpoint)
    data = {"class_path": "tasks.data.mlm.MaskedLMDataModule",
            "init_args": {"max_bytes": 20000, "max_seq_len": N, "batch_size": 8}}  # fmt: skip
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": data, "ckpt_path": None}))
    return checkpoint


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


# ---- shared helpers -----------------------------------------------------------------------------------------


def test_load_run_restores_the_weights_and_the_control_is_a_fresh_draw(tmp_path):
    checkpoint = write_run(tmp_path / "run", seed=3)
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    trained = load_run(checkpoint)
    control = load_run(checkpoint, random_init_seed=0)
    name = "encoder.layers.0.attn.to_q.weight"
    assert torch.equal(trained.task.state_dict()[name], saved[name])
    assert not torch.equal(control.task.state_dict()[name], saved[name])
    assert trained.max_seq_len == N and not trained.task.training


def test_captured_inputs_reproduce_each_layers_attention_output(tmp_path):
    """softmax(q k^T / sqrt(d)) v from the captured q, k, v, through the block's output projection, is what
    the block returned: the hooks see exactly the mechanism's inputs."""
    run = load_run(write_run(tmp_path / "run"))
    tokens = torch.randint(4, 260, (2, N))
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, 20:] = False
    outputs = []
    blocks = [layer.attn for layer in run.encoder.layers]
    handles = [b.register_forward_hook(lambda m, a, out: outputs.append(out)) for b in blocks]
    with AttentionInputs(run.encoder) as layers, torch.no_grad():
        run.task(tokens, mask)
    for handle in handles:
        handle.remove()
    assert len(layers) == 2 and torch.equal(layers[0].mask, mask)
    for block, inputs, out in zip(blocks, layers, outputs, strict=True):
        scores = inputs.q @ inputs.k.mT / math.sqrt(inputs.q.shape[-1])
        probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
        heads = (probs @ inputs.v).transpose(1, 2).flatten(2)
        torch.testing.assert_close(block.to_out(heads), out, rtol=1e-5, atol=1e-5)
    assert all(not b.core._forward_pre_hooks for b in blocks)  # hooks removed on exit


# ---- spectrum -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_a_context_matrix_of_rank_r_reaches_one_at_index_r(rank):
    """P = A B with A (n x r) and B (r x n) row-stochastic is a row-stochastic matrix of rank r."""
    generator = torch.Generator().manual_seed(rank)
    a = torch.rand(40, rank, generator=generator, dtype=torch.float64)
    b = torch.rand(rank, 40, generator=generator, dtype=torch.float64)
    probs = (a / a.sum(1, keepdim=True)) @ (b / b.sum(1, keepdim=True))
    curve = normalized_cumulative(torch.linalg.svdvals(probs))
    assert curve[rank - 1].item() == pytest.approx(1.0, abs=1e-12)
    if rank > 1:
        assert curve[rank - 2].item() < 1 - 1e-3


def test_spectrum_of_attention_with_r_distinct_queries_is_rank_r():
    """softmax(q k^T) with only r distinct query rows has r distinct rows, so rank r; padding is left out."""
    from attention_zoo import create_attention

    rank, n, d = 3, 24, 8
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randn(rank, d, generator=generator)
    q = distinct[torch.arange(n) % rank][None, None].repeat(1, 2, 1, 1)
    k = torch.randn(1, 2, n, d, generator=generator)
    real = torch.ones(n, dtype=torch.bool)
    real[20:] = False
    curves = context_spectrum(create_attention("full", dim_head=d, heads=2), q, k, real)
    assert curves.shape == (2, 20)
    assert torch.allclose(curves[:, rank - 1], torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert (curves[:, rank - 2] < 1 - 1e-4).all()


def test_zoo_study_spectrum_writes_curves_heatmaps_and_replots(tmp_path):
    checkpoint = write_run(tmp_path / "run")
    out = tmp_path / "spectrum"
    argv = ["study", "spectrum", "--checkpoint", str(checkpoint), "--sequences", "5", "--k", "4", "--out", str(out)]
    assert cli.main(argv) == 0
    curves = rows(out / "spectrum.csv")
    assert len(curves) == 2 * 2 * 2 * N  # models x layers x heads x indices
    assert {r["model"] for r in curves} == {"trained", "random init"}
    assert all(r["sequences"] == "5" for r in curves)
    for r in curves:
        assert 0 < float(r["mean"]) <= 1 + 1e-9
        if r["index"] == str(N):
            assert float(r["mean"]) == pytest.approx(1.0)
    at_k = rows(out / "spectrum_at_k4.csv")
    assert len(at_k) == 8 and {r["k"] for r in at_k} == {"4"}
    for r in at_k:  # the heatmap's value is the curve's at index k
        curve = next(c for c in curves if (c["model"], c["layer"], c["head"], c["index"]) ==
                     (r["model"], r["layer"], r["head"], "4"))  # fmt: skip
        assert r["mean"] == curve["mean"]
    assert json.loads((out / "spectrum.json").read_text())["sequences"] == 5
    events = sorted(p.relative_to(out).parent.name for p in (out / "tensorboard").rglob("events.out.tfevents.*"))
    assert events == ["fig1_left", "fig1_right_k4"]
    for name in ("fig1_left.png", "fig1_right_k4.png"):
        (out / name).unlink()
    assert cli.main(["study", "spectrum", "--replot", str(out)]) == 0  # k from spectrum.json
    assert (out / "fig1_left.png").is_file() and (out / "fig1_right_k4.png").is_file()
    # a replot replaces each figure's event file instead of adding one
    replotted = sorted(p.relative_to(out).parent.name for p in (out / "tensorboard").rglob("events.out.tfevents.*"))
    assert replotted == events
    assert cli.main(["study", "spectrum", "--replot", str(out), "--k", "2"]) == 0
    assert (out / "fig1_right_k2.png").is_file() and {r["k"] for r in rows(out / "spectrum_at_k2.csv")} == {"2"}


def test_spectrum_refuses_a_model_without_full_attention(tmp_path):
    checkpoint = write_run(tmp_path / "run", "linformer", {"k": 8})
    with pytest.raises(ValueError, match="full softmax attention"):
        cli.main(
            ["study", "spectrum", "--checkpoint", str(checkpoint), "--sequences", "2", "--out", str(tmp_path / "o")]
        )


# ---- approximation error ------------------------------------------------------------------------------------


def gaussian_head(n: int = 64, d: int = 8, seed: int = 0) -> am.Head:
    generator = torch.Generator().manual_seed(seed)
    return am.Head(*(torch.randn(n, d, generator=generator, dtype=torch.float64) for _ in range(3)), index=0)


def method(name: str) -> am.Method:
    return next(m for m in am.METHODS if m.name == name)


def test_low_rank_is_the_truncated_svd_of_p():
    head = gaussian_head()
    u, s, vh = torch.linalg.svd(head.probs)
    for rank in (1, 5, 20):
        truncated = u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]
        torch.testing.assert_close(head.low_rank(rank), truncated @ head.v, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(head.low_rank(head.n), head.exact, rtol=1e-9, atol=1e-11)


def test_svd_floor_is_below_the_jl_projection():
    """Eckart-Young-Mirsky: ||P_k - P||_F <= ||P R^T R - P||_F for the rank-k P R^T R, always; and for the
    output with Gaussian V (independent of R) the floor is far below JL's error as well."""
    for seed in range(3):
        head = gaussian_head(seed=seed)
        identity = am.Head(head.q, head.k, torch.eye(head.n, dtype=torch.float64), index=0)
        for k in (2, 8, 16, 32):
            p_k, jl_p = identity.low_rank(k), am.jl_output(identity, k, seed)
            assert (p_k - head.probs).norm() <= (jl_p - head.probs).norm()
            svd_error, _ = head.errors(am.method_output(method("svd"), k, head, seed), method("svd"))
            jl_error, _ = head.errors(am.method_output(method("jl"), k, head, seed), method("jl"))
            assert svd_error <= jl_error


def test_lemma_normalised_jl_error_is_about_one_over_sqrt_k():
    """JL lemma (12): |x R^T R y - x y| has standard deviation ~ ||x|| ||y|| / sqrt(k)."""
    for k in (8, 32):
        errors = [gaussian_head(n=128, seed=s).errors(am.jl_output(gaussian_head(n=128, seed=s), k, s), method("jl"))[1]
                  for s in range(4)]  # fmt: skip
        assert 0.7 < sum(errors) / len(errors) * math.sqrt(k) < 1.4


def test_error_curves_are_finite_and_fall_to_zero_in_the_exact_limit():
    n = 64
    heads = [gaussian_head(n=n, seed=s) for s in range(3)]

    def curve(m: am.Method, budgets) -> list[float]:
        return [sum(h.errors(am.method_output(m, b, h, 0), m)[0] for h in heads) / len(heads) for b in budgets]

    landmarks = curve(method("nystrom"), (4, 8, 16, 32, 64))
    assert all(math.isfinite(e) for e in landmarks)
    assert all(a > b for a, b in zip(landmarks, landmarks[1:], strict=False)), landmarks
    exact_pinv = curve(method("nystrom-exact-pinv"), (4, 16, n))
    assert all(math.isfinite(e) for e in exact_pinv) and exact_pinv[-1] < 1e-10
    iterations = curve(am.Method("it", "nystrom", "pinv_iterations", (), {"num_landmarks": n}), (1, 2, 4, 8, 16, 30))
    assert all(a > b for a, b in zip(iterations, iterations[1:], strict=False)) and iterations[-1] < 1e-10
    floor = curve(method("svd"), (1, 4, 16, n - 1))
    assert all(a > b for a, b in zip(floor, floor[1:], strict=False)) and floor[-1] < 1e-3
    window = curve(method("local"), (8, 32, 2 * n))
    assert window[0] > window[1] and window[-1] < 1e-12


def test_lsh_is_compared_with_its_own_exact_limit():
    """Reformer Sec. 2: shared-QK attention, keys k_j = q_j / ||q_j||, a token attends to itself only when it has
    no other key; scores q_i . k_j with no further scale, as the authors' trax code; LSH's reference is that,
    computed here from the definition."""
    head = gaussian_head()
    lsh = method("lsh-hashes")
    scores = head.q @ (head.q / head.q.norm(dim=-1, keepdim=True)).mT
    shared_qk = scores.fill_diagonal_(float("-inf")).softmax(-1) @ head.v
    torch.testing.assert_close(head.reference(lsh), shared_qk, rtol=1e-10, atol=1e-12)
    assert head.errors(shared_qk, lsh) == (pytest.approx(0, abs=1e-10), None)
    relative, _ = head.errors(am.method_output(lsh, 2, head, 0), lsh)
    assert 0 < relative < 10


def test_learned_projections_reproduce_the_models_own_linformer_heads(tmp_path):
    for sharing in ("none", "headwise", "layerwise"):
        run = load_run(write_run(tmp_path / sharing, "linformer", {"k": 8, "sharing": sharing}))
        bank = am.LearnedProjections(run.encoder, run.label)
        assert bank.method.name == "linformer-learned" + ("" if sharing == "headwise" else f"-{sharing}")
        layers = capture(run, torch.randint(4, 260, (1, N)), torch.ones(1, N, dtype=torch.bool))
        for layer, inputs in enumerate(layers):
            with torch.no_grad():
                own = bank.cores[layer](inputs.q, inputs.k, inputs.v)
            for h in range(2):
                head = am.Head(inputs.q[0, h], inputs.k[0, h], inputs.v[0, h], h)
                torch.testing.assert_close(bank.output(head, layer, h), own[0, h].double(), rtol=1e-5, atol=1e-6)


def test_zoo_study_approx_writes_rows_resumes_and_replots(tmp_path):
    full = write_run(tmp_path / "exp" / "full" / "seed-0")
    learned = write_run(tmp_path / "exp" / "linformer" / "seed-0", "linformer", {"k": 8})
    out = tmp_path / "approx"
    argv = ["study", "approx", "--lengths", "[16, 32]", "--samples", "2", "--dim_head", "8", "--sequences", "1",
            "--methods", "[svd, jl, linformer-random, nystrom]", "--trained", f"[{full}]",
            "--learned", f"[{learned}]", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    errors = rows(out / "errors.csv")
    gaussian = [r for r in errors if r["input"] == "gaussian"]
    # budgets per draw: n = 16: svd none (k < n), jl and linformer k = 16, nystrom m = 8, 16; n = 32: svd k = 16,
    # jl and linformer k = 16, 32, nystrom m = 8, 16, 32; and the learned E, F of both layers (trained at n = 32)
    assert len(gaussian) == 2 * (4 + 8 + 2)
    trained = [r for r in errors if r["input"] == "trained"]
    assert {r["model"] for r in trained} == {"full", "linformer"}
    assert {r["method"] for r in trained if r["model"] == "linformer"} == {"svd", "linformer-learned"}
    assert all(r["rel_error"] and math.isfinite(float(r["rel_error"])) for r in errors), [
        r for r in errors if r["note"]
    ]
    summary = rows(out / "summary.csv")
    assert {(r["input"], r["method"]) for r in summary} >= {("gaussian", "linformer-learned"), ("trained", "svd")}
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures == ["error_vs_budget_gaussian.png", "error_vs_budget_trained.png", "theorem2_gaussian.png",
                       "theorem2_trained.png"]  # fmt: skip

    argv += ["--plot", "false"]
    assert cli.main(argv) == 0  # a rerun finds every row done
    assert rows(out / "errors.csv") == errors
    kept = [r for r in errors if not (r["method"] == "nystrom" and r["n"] == "32")]
    with open(out / "errors.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(errors[0]))
        writer.writeheader()
        writer.writerows(kept)
    assert cli.main(argv) == 0  # only the removed rows are measured again, with the same values
    again = rows(out / "errors.csv")
    assert len(again) == len(errors)
    key = lambda r: (r["input"], r["source"], r["n"], r["sample"], r["layer"], r["head"], r["method"], r["budget"])
    assert sorted(again, key=key) == sorted(errors, key=key)

    for path in out.glob("*.png"):
        path.unlink()
    assert cli.main(["study", "approx", "--replot", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == figures


def test_a_method_that_cannot_run_is_recorded_with_its_reason():
    head = gaussian_head(n=16)
    from experiments.studies.approx import Job, Unit, run_unit

    broken = am.Method("local", "local", "window", (3,))  # odd window: the core refuses it
    unit = Unit("gaussian", "-", "gaussian", 16, 8, 0, 1, 0, lambda: (head.q[None], head.k[None], head.v[None]),
                [Job(broken, 3, -1, lambda h, s: am.method_output(broken, 3, h, s))])  # fmt: skip
    (row,) = run_unit(unit, set())
    assert row["rel_error"] == "" and "window must be an even int" in row["note"]


# ---- MLM perplexity -----------------------------------------------------------------------------------------


def test_zoo_study_mlm_collects_curves_states_coverage_and_replots(tmp_path):
    configs, runs_dir = tmp_path / "configs", tmp_path / "runs"
    configs.mkdir()
    config = {"experiment": "mlm-tiny", "runs_dir": "ignored", "seed": 0, "seeds": 2,
              "attentions": "full,linformer:k=8", "fit_args": [f"--data.max_seq_len={N}"]}  # fmt: skip
    (configs / "a.yaml").write_text(yaml.safe_dump(config))
    finals = {("full", 0): 5.0, ("full", 1): 5.2, ("linformer", 0): 6.0}
    for (label, seed), final in finals.items():
        directory = runs_dir / "mlm-tiny" / label / f"seed-{seed}"
        writer = SummaryWriter(str(directory))
        for step in (9, 19):
            writer.add_scalar("val/ppl", final + (19 - step), step)
        writer.close()
        if (label, seed) == ("full", 0):  # a resumed run logs step 19 again in a new event file: the later counts
            writer = SummaryWriter(str(directory), filename_suffix=".resumed")
            writer.add_scalar("val/ppl", final, 19)
            writer.close()
        (directory / "run.json").write_text(json.dumps({"status": "finished", "step": 20, "max_steps": 20,
                                                        "metrics": {"val/ppl": final}}))  # fmt: skip
    out = tmp_path / "mlm"
    assert cli.main(["study", "mlm", "--configs", str(configs), "--runs_dir", str(runs_dir), "--out", str(out)]) == 0
    curves = rows(out / "curves.csv")
    assert len(curves) == 3 * 2
    assert [float(r["val_ppl"]) for r in curves if r["label"] == "full" and r["seed"] == "0"] == [15.0, 5.0]
    table = {(r["attention"], r["k"]): r for r in rows(out / "table.csv")}
    assert table[("full", "")]["seeds_finished"] == "2" and float(table[("full", "")]["mean"]) == pytest.approx(5.1)
    assert float(table[("full", "")]["std"]) == pytest.approx(math.sqrt(0.02), abs=1e-4)
    assert table[("linformer", "8")]["seeds"] == "0" and table[("linformer", "8")]["sharing"] == "headwise"
    markdown = (out / "table.md").read_text()
    assert "3 of 4 expected runs finished" in markdown and "mlm-tiny/linformer/seed-1: missing" in markdown
    (out / "fig3.png").unlink()
    assert cli.main(["study", "mlm", "--replot", str(out)]) == 0
    assert (out / "fig3.png").is_file()


@pytest.mark.parametrize("scale", ["full", "small"])
def test_the_committed_mlm_configs_name_every_panel(scale):
    from experiments.studies.mlm import CONFIGS, expected_runs

    runs = expected_runs(CONFIGS if scale == "full" else CONFIGS / "small", Path("runs"))
    assert len({r.experiment for r in runs}) == 4 and {r.seed for r in runs} == {0, 1, 2}
    variants = {(r.n, r.attention, r.k, r.sharing) for r in runs}
    for n in (512, 1024):
        assert {(n, "linformer", k, "headwise") for k in (32, 64, 128, 256)} | {(n, "full", None, "")} <= variants
    assert {(512, "linformer", 128, s) for s in ("none", "kv", "layerwise")} <= variants
    assert {(2048, "full", None, ""), (2048, "linformer", 128, "headwise")} <= variants


def test_the_independent_favor_check_runs_and_falls_with_m_on_small_inputs(capsys):
    from experiments.studies import favor_independent_check as favor

    assert favor.main(["--n", "32", "--samples", "2", "--features", "16,1024"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[0] for row in rows] == ["16", "1024"]
    # q, k scaled by 1/2: the estimator's error falls as 1/sqrt(m) (Lemma 2), 64x more features -> well below
    assert float(rows[1][2]) < 0.5 * float(rows[0][2])


def test_the_independent_mlm_check_trains_both_models_at_a_tiny_size(capsys):
    from experiments.studies import mlm_independent_check as mlm_check

    argv = ["--steps", "2", "--warmup", "1", "--every", "2", "--n", "32", "--batch", "1", "--val_batches", "1"]
    assert mlm_check.main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("step 2: val ppl library ") and " reference " in last
    ppl = [float(part.split()[-1]) for part in last.split("val ppl ")[1].split("(")[0].split(",")]
    assert all(math.isfinite(p) and p > 1 for p in ppl)
