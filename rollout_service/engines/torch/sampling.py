"""Token sampling of the torch engine, per request with the request's own
`torch.Generator`, so a request's samples do not depend on its batch-mates.

Temperature T > 0 samples from softmax(logits / T), restricted to the top-p nucleus and
renormalised (Holtzman et al. 2020, Sec. 3.1), by inverse-CDF with one uniform draw per
token. The reported log-prob is that of the token under this exact distribution. T = 0 is
greedy: the token is the argmax and its reported log-prob is log softmax(logits) at the
argmax, i.e. under the untempered distribution (the greedy "distribution" is a point mass
whose log-prob, 0, says nothing).
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits [N, vocab] fp32; per-row temperature (0 = greedy),
    top_p and generator (None for greedy rows). Returns tokens [N] long and their fp32
    log-probs [N] under the distribution sampled from (see the module docstring).

    Each non-greedy row draws exactly one uniform u from its own generator and takes the
    first token whose cumulative probability reaches u (inverse-CDF sampling), so a row's
    draw does not depend on the other rows.
    """
    rows = logits.shape[0]
    index = torch.arange(rows, device=logits.device)
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    greedy = temps == 0
    scale = torch.where(greedy, 1.0, temps)[:, None]
    top_p = torch.tensor(top_ps, dtype=torch.float32, device=logits.device)
    nucleus = ~greedy & (top_p < 1.0)
    uniforms = torch.tensor(
        [float(torch.rand((), generator=g)) if g is not None else 0.0 for g in generators],
        dtype=torch.float32,
        device=logits.device,
    )
    if bool(nucleus.any()):
        logp = torch.log_softmax(logits / scale, dim=-1)
        logp = torch.where(nucleus[:, None], top_p_renormalise(logp, top_p), logp)
        cdf = logp.exp().cumsum_(dim=-1)
    else:
        # Without a nucleus the [N, vocab] log-probs are never needed whole: one buffer
        # becomes exp(x - max), then its running sum, in place (a decode step of 64 rows
        # x 49k vocab spent 40 ms in four full-vocab temporaries; this is one). The CDF is
        # left unnormalised: the draw below scales u by its total.
        scaled = logits / scale
        peak = scaled.amax(dim=-1, keepdim=True)
        cdf = scaled.sub_(peak).exp_().cumsum_(dim=-1)
        lse = peak + cdf[:, -1:].log()
        logp = None
    # u * total guards against a cdf ending slightly below 1; the floor keeps u = 0 from
    # picking a leading zero-probability token.
    target = (uniforms * cdf[:, -1]).clamp_min(torch.finfo(torch.float32).tiny)
    drawn = torch.searchsorted(cdf, target[:, None])[:, 0].clamp_max(logits.shape[1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn) if bool(greedy.any()) else drawn
    if logp is not None:
        return tokens, logp[index, tokens]
    return tokens, logits[index, tokens] / scale[:, 0] - lse[:, 0]


def top_p_renormalise(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2020, Sec. 3.1): keep the smallest set of most likely
    tokens whose mass reaches top_p [N], renormalise. logp [N, vocab] -> [N, vocab], with
    -inf outside the nucleus."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = mass_before < top_p[:, None]  # the most likely token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    kept = logp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)
