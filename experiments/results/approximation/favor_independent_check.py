"""An independent FAVOR+ (not the library's): is Performer's flat error on Gaussian inputs the estimator's or a bug?

Choromanski et al. 2021 (arXiv:2009.14794), Lemma 1: SM(x, y) = E_w[exp(w.x - |x|^2/2) exp(w.y - |y|^2/2)],
w ~ N(0, I_d), with x = q / d^(1/4), y = k / d^(1/4); the attention is D^-1 phi(Q) (phi(K)^T V) (eq. 7),
here with i.i.d. (not orthogonal) w, in float64, written from the paper only. Lemma 2: the estimator's MSE is
(1/m) exp(|x + y|^2) SM(x, y)^2 (1 - exp(-|x + y|^2)), so with N(0, 1) entries at d = 64
(|x + y|^2 about 2 d / sqrt(d) = 16) its relative error stays large until m is far beyond 10^4.

    python experiments/results/approximation/favor_independent_check.py
"""

import math

import torch

D, N, SAMPLES = 64, 256, 4


def relative_error(m: int, scale: float) -> float:
    errors = []
    for sample in range(SAMPLES):
        generator = torch.Generator().manual_seed(sample)
        q, k, v = (torch.randn(N, D, generator=generator, dtype=torch.float64) for _ in range(3))
        q, k = scale * q, scale * k
        exact = torch.softmax(q @ k.T / math.sqrt(D), dim=-1) @ v
        x, y = q / D**0.25, k / D**0.25
        w = torch.randn(m, D, generator=generator, dtype=torch.float64)
        phi_x = torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2)
        phi_y = torch.exp(y @ w.T - (y * y).sum(-1, keepdim=True) / 2)
        approx = phi_x @ (phi_y.T @ v) / (phi_x @ phi_y.sum(0)).unsqueeze(-1)
        errors.append(((approx - exact).norm() / exact.norm()).item())
    return sum(errors) / len(errors)


if __name__ == "__main__":
    print(f"n = {N}, d = {D}, mean relative error over {SAMPLES} draws")
    print("m      q, k ~ N(0, 1)   q, k ~ N(0, 1/4)")
    for m in (16, 64, 256, 1024, 4096):
        print(f"{m:<6} {relative_error(m, 1.0):<16.3f} {relative_error(m, 0.5):.3f}")
