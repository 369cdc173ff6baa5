"""Sampling parameters and the pure, batched sampling step.

Logprob convention (documented for RL users): the logprob reported for a token
is ``log_softmax(logits / temperature)`` at that position, taken *before*
repetition/presence/frequency penalties and top-k / top-p / min-p filtering. At temperature 1 it is exactly the model's
log-probability (what a trainer's forward pass computes); at temperature 0
(greedy) the temperature is treated as 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request generation settings (validated by the HTTP layer)."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition-style penalty changes the sampling distribution."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class SampleOutput:
    """Result of one batched sampling step."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    token_tensor: torch.Tensor | None = None


def filter_logits(
    logp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    needs: tuple[bool, bool, bool] | None = None,
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set.

    ``logp`` is ``[B, V]`` log-probabilities; ``top_k`` (``<=0`` disables),
    ``top_p`` and ``min_p`` are ``[B]``. The most likely token always survives.
    ``needs`` (whether any row uses top-k, top-p, min-p), when the caller knows it,
    saves reading the tensors back from the device.
    """
    if needs is None:
        needs = (bool((top_k > 0).any()), bool((top_p < 1.0).any()), bool((min_p > 0.0).any()))
    needs_k, needs_p, needs_min = needs
    if not (needs_k or needs_p or needs_min):
        return logp
    vocab = logp.shape[-1]
    sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
    remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
    ranks = torch.arange(vocab, device=logp.device).unsqueeze(0)
    if needs_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        remove |= ranks >= k
    probs = sorted_lp.exp()
    if needs_p:
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above this token
        remove |= before >= top_p.unsqueeze(1)
    if needs_min:
        remove |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    remove[:, 0] = False
    filtered_sorted = sorted_lp.masked_fill(remove, float("-inf"))
    return torch.empty_like(logp).scatter_(-1, order, filtered_sorted)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """Return ``logits`` with each row's penalties applied (vLLM semantics).

    ``histories[i]`` is ``(prompt_ids, generated_ids)``. Presence and frequency
    penalties subtract ``presence * [count > 0] + frequency * count`` over generated
    tokens; the repetition penalty divides positive (multiplies negative) logits of
    every token seen in the prompt or the output.
    """
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, (p, (prompt, generated)) in enumerate(zip(params, histories, strict=True)):
        if not p.has_penalties:
            continue
        if generated and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=vocab)[
                :vocab
            ].to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(generated)), device=logits.device)
            vals = out[i, seen]
            out[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    return out


def param_tensors(
    params: list[SamplingParams], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(temperature, top_k, top_p, min_p)`` of ``params`` as ``[B]`` tensors.

    Raises ``ValueError`` or ``RuntimeError`` for values torch cannot hold (e.g.
    ``top_k`` = 2^63), so the engine can refuse that request alone before queueing it.
    """
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temps, top_k, top_p, min_p


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[tuple[list[int], list[int]]] | None = None,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` (``[B, V]``) under that row's params.

    ``histories`` (``(prompt_ids, generated_ids)`` per row) is needed only when a
    row has penalties; they shape the choice but not the reported logprobs.
    ``tensors`` are the rows' :func:`param_tensors` when the caller keeps them on the
    device already (the engine stores them per cache slot).

    Sampling is by inverse CDF (one uniform per row, cheap on CPU). Rows with a
    generator draw their uniform from it (reproducible per request seed); the
    others from torch's global generator.
    """
    logits = logits.float()
    rows = logits.shape[0]
    temps, top_k, top_p, min_p = tensors or param_tensors(params, logits.device)
    greedy_rows = sum(p.temperature <= 0 for p in params)
    greedy = temps <= 0
    scale = torch.where(greedy, torch.ones_like(temps), temps) if greedy_rows else temps
    plain = not greedy_rows and all(p.temperature == 1.0 for p in params)
    logp = torch.log_softmax(logits if plain else logits / scale.unsqueeze(1), dim=-1)
    pick_lp = logp
    if histories is not None and any(p.has_penalties for p in params):
        penalized = apply_penalties(logits, params, histories)
        pick_lp = torch.log_softmax(penalized / scale.unsqueeze(1), dim=-1)
    if greedy_rows == rows:
        chosen = torch.argmax(pick_lp, dim=-1)
    else:
        needs = (
            any(p.top_k > 0 for p in params),
            any(p.top_p < 1.0 for p in params),
            any(p.min_p > 0.0 for p in params),
        )
        if any(needs):
            probs = torch.softmax(filter_logits(pick_lp, top_k, top_p, min_p, needs), dim=-1)
        else:
            probs = pick_lp.exp()
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand(rows, 1, device=logits.device)
        for i, gen in enumerate(generators):
            if gen is not None:
                uniform[i, 0] = torch.rand(1, generator=gen, device=logits.device)[0]
        drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
        chosen = drawn.clamp(max=logits.shape[-1] - 1)
        if greedy_rows:
            chosen = torch.where(greedy, torch.argmax(pick_lp, dim=-1), chosen)
    token_lp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    top: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
    max_top = max((p.logprobs or 0) for p in params)
    if max_top > 0:
        values, ids = torch.topk(logp, k=min(max_top, logp.shape[-1]), dim=-1)
        values_l, ids_l = values.tolist(), ids.tolist()
        for i, p in enumerate(params):
            k = p.logprobs or 0
            top[i] = list(zip(ids_l[i][:k], values_l[i][:k], strict=True))
    return SampleOutput(chosen.tolist(), token_lp.tolist(), top, chosen)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], k: int
) -> list[dict[int, float] | None]:
    """vLLM-style prompt logprobs: ``None`` for position 0, then per position a dict
    of the actual prompt token's logprob plus the top-``k`` alternatives.

    ``logits`` are the model outputs for the prompt, ``[L, V]`` (position i predicts i+1).
    """
    out: list[dict[int, float] | None] = [None]
    if len(prompt_ids) < 2:
        return out
    return out + prompt_logprob_entries(logits[: len(prompt_ids) - 1], prompt_ids[1:], k)


def prompt_logprob_entries(
    logits: torch.Tensor, targets: list[int], k: int
) -> list[dict[int, float] | None]:
    """One :func:`prompt_logprobs` entry per row of ``logits`` (``[N, V]``), whose next
    token is ``targets[i]``; a chunked prefill calls this once per chunk."""
    if not targets:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, device=logp.device)
    actual = logp.gather(1, index.unsqueeze(1)).squeeze(1).tolist()
    tops_v: list[list[float]] = [[] for _ in actual]
    tops_i: list[list[int]] = [[] for _ in actual]
    if k > 0:
        v, i = torch.topk(logp, k=min(k, logp.shape[-1]), dim=-1)
        tops_v, tops_i = v.tolist(), i.tolist()
    out: list[dict[int, float] | None] = []
    for pos, token in enumerate(targets):
        entry = {token: actual[pos]}
        for tid, lp in zip(tops_i[pos], tops_v[pos], strict=True):
            entry.setdefault(tid, lp)
        out.append(entry)
    return out
