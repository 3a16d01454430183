"""An independent FAVOR+ (not the library's): is Performer's flat error on Gaussian inputs the estimator's or a bug?

Choromanski et al. 2021 (arXiv:2009.14794), Lemma 1: SM(x, y) = E_w[exp(w.x - |x|^2/2) exp(w.y - |y|^2/2)],
w ~ N(0, I_d), with x = q / d^(1/4), y = k / d^(1/4); the attention is D^-1 phi(Q) (phi(K)^T V) (eq. 7),
here with i.i.d. (not orthogonal) w, in float64, written from the paper only. Lemma 2: the estimator's MSE is
(1/m) exp(|x + y|^2) SM(x, y)^2 (1 - exp(-|x + y|^2)), so with N(0, 1) entries at d = 64
(|x + y|^2 about 2 d / sqrt(d) = 16) its relative error stays large until m is far beyond 10^4.

    python -m experiments.studies.favor_independent_check       # output: results/approximation/
"""

from __future__ import annotations

import argparse
import math

import torch

D = 64


def relative_error(m: int, scale: float, n: int = 256, samples: int = 4) -> float:
    """Mean relative error ||approx - exact|| / ||exact|| over ``samples`` draws of q, k, v and the features."""
    errors = []
    for sample in range(samples):
        generator = torch.Generator().manual_seed(sample)
        q, k, v = (torch.randn(n, D, generator=generator, dtype=torch.float64) for _ in range(3))
        q, k = scale * q, scale * k
        exact = torch.softmax(q @ k.T / math.sqrt(D), dim=-1) @ v
        x, y = q / D**0.25, k / D**0.25
        w = torch.randn(m, D, generator=generator, dtype=torch.float64)
        phi_x = torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2)
        phi_y = torch.exp(y @ w.T - (y * y).sum(-1, keepdim=True) / 2)
        approx = phi_x @ (phi_y.T @ v) / (phi_x @ phi_y.sum(0)).unsqueeze(-1)
        errors.append(((approx - exact).norm() / exact.norm()).item())
    return sum(errors) / len(errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=256, help="sequence length (default 256)")
    parser.add_argument("--samples", type=int, default=4, help="draws averaged per cell (default 4)")
    parser.add_argument("--features", default="16,64,256,1024,4096", help="comma-separated m (default 16,...,4096)")
    args = parser.parse_args(argv)
    print(f"n = {args.n}, d = {D}, mean relative error over {args.samples} draws")
    print("m      q, k ~ N(0, 1)   q, k ~ N(0, 1/4)")
    for m in (int(x) for x in args.features.split(",")):
        full, half = (relative_error(m, scale, args.n, args.samples) for scale in (1.0, 0.5))
        print(f"{m:<6} {full:<16.3f} {half:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
