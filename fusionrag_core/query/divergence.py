"""How far a served answer's first token is from full attention's: KL and greedy agreement.

The quality measure of the whole project (live audits, `fusionrag bench`, the studies): it needs no
gold answer and no sampling, and a tiny model shows it as well as a large one.
"""

from __future__ import annotations

import torch

from fusionrag_core.errors import InvalidRequestError


def _check_logits_pair(logits_ref: torch.Tensor, logits_method: torch.Tensor) -> None:
    if logits_ref.dim() != 1 or logits_method.dim() != 1:
        raise InvalidRequestError(
            f"expected 1-D last-position logits [vocab], got shapes {tuple(logits_ref.shape)} and "
            f"{tuple(logits_method.shape)}; pass logits[0, -1] of the prefill output"
        )
    if logits_ref.shape != logits_method.shape:
        raise InvalidRequestError(
            f"logits have different vocabulary sizes ({logits_ref.shape[0]} vs {logits_method.shape[0]}); "
            "both must come from the same model"
        )


def first_token_kl(logits_ref: torch.Tensor, logits_method: torch.Tensor) -> float:
    """KL(P_ref || P_method) of the next-token distributions after the prompt.

    Measures how far a method's first generated token distribution drifts from full attention's
    without depending on sampling or answer parsing. Computed in float64 from `log_softmax`, so
    bf16/fp16 logits of a near-identical method do not produce rounding noise or negative values.

    Args:
        logits_ref: `[vocab]` last-position logits of the reference (full attention).
        logits_method: `[vocab]` last-position logits of the method, same model.

    Returns:
        KL divergence in nats, >= 0; `inf` if the method gives zero probability to a token the
        reference does not (e.g. a masked logit).

    Raises:
        InvalidRequestError: The tensors are not 1-D or differ in size.
    """
    _check_logits_pair(logits_ref, logits_method)
    log_p = torch.log_softmax(logits_ref.detach().to("cpu", torch.float64), dim=0)
    log_q = torch.log_softmax(logits_method.detach().to("cpu", torch.float64), dim=0)
    p = log_p.exp()
    # Tokens with p == 0 contribute 0 (limit of p log p); without the mask, -inf logits give 0 * nan.
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    # Rounding can leave a tiny negative sum for identical distributions; KL is >= 0 by definition.
    return max(float(terms.sum()), 0.0)


def first_token_agree(logits_ref: torch.Tensor, logits_method: torch.Tensor) -> bool:
    """Whether the greedy first token of the method equals the reference's (argmax equal).

    Raises:
        InvalidRequestError: The tensors are not 1-D or differ in size.
    """
    _check_logits_pair(logits_ref, logits_method)
    return int(torch.argmax(logits_ref)) == int(torch.argmax(logits_method))
