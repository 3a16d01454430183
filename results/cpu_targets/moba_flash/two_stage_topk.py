"""A try on MoBA's gate, measured and dropped: the top 4 of each query's block scores found in two stages (the
top 4 of the maxima of groups of 4 or 8 blocks, then the top 4 of those groups' members; exact: a block in the top
4 has its group among the 4 best groups) against one torch.topk, on causal-masked scores of B = 1, H = 8 and n / 128
blocks; values and picks compared first; one thread, minimum of 7 calls.

    python -m results.cpu_targets.moba_flash.two_stage_topk
"""

import torch

from results.ab_timing import best_ms

torch.set_num_threads(1)


def two_stage(s, k, group):
    # s (..., C) with C % group == 0; returns values, indices of the top k (sorted), as topk
    *lead, c = s.shape
    g = s.view(*lead, c // group, group)
    gmax = g.amax(dim=-1)
    top_groups = gmax.topk(min(k, c // group), dim=-1).indices  # (..., k)
    members = top_groups.unsqueeze(-1) * group + torch.arange(group)  # (..., k, group)
    members = members.flatten(-2)
    vals = s.gather(-1, members)
    best = vals.topk(k, dim=-1)
    return best.values, members.gather(-1, best.indices)


g = torch.Generator().manual_seed(0)
for n in (2048, 4096, 8192):
    blocks = n // 128
    s = torch.randn(1, 8, n, blocks, generator=g)
    own = torch.arange(n) // 128
    s.masked_fill_(~(torch.arange(blocks)[None, :] < own[:, None]), float("-inf"))
    ref = s.topk(4, dim=-1)
    for group in (4, 8):
        v, i = two_stage(s, 4, group)
        fin = ref.values > float("-inf")
        assert torch.equal(v, ref.values), "values"
        assert torch.equal(i[fin], ref.indices[fin]), "indices"
    print(
        n,
        f"topk {best_ms(lambda s=s: s.topk(4, dim=-1), 7):.2f}",
        *(f"two-stage/{gr} {best_ms(lambda s=s, gr=gr: two_stage(s, 4, gr), 7):.2f}" for gr in (4, 8)),
    )
