"""The query-guided probe: the question run over a stitched cache, for the attention it pays each token.

A query-guided selector ranks chunk tokens by how much the question attends to them (`select`).
That takes a pass of the question's tokens over the stitched buffer up to the deepest layer read:
the probe. `Probe` names one request's probe; `masses` runs it alone, `run_probes` runs several
requests' probes as one pass (the rows share every product) and leaves each one's masses in its
`Stitched.probed`, where its selector finds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusionrag_core.query.stitch import Stitched


@dataclass(frozen=True)
class Probe:
    """One request's probe: its question at its slots, the mass read at `layers`.

    Attributes:
        st: the stitched request.
        layers: the layers whose masses are read (`probe_layers`), shallowest first.
        last_share: the share of the mass taken from the question's last token (`question_weights`).
    """

    st: Stitched
    layers: tuple[int, ...]
    last_share: float | None

    @classmethod
    def at(cls, st: Stitched, depths: tuple[float, ...], last_share: float | None) -> Probe:
        """The probe of `st`'s question at relative `depths` (`probe_layers`): the one constructor,
        so a probe run beforehand has the key its selector looks for."""
        return cls(st, probe_layers(st.decoder.windows, depths), last_share)

    @property
    def key(self) -> tuple[tuple[int, ...], float | None]:
        """What tells this probe's masses from another probe's of the same request."""
        return self.layers, self.last_share

    def weights(self) -> torch.Tensor | None:
        """`[Q]` the question tokens' weights in the mass (None: 1 each)."""
        return question_weights(int(self.st.question_slots.shape[0]), self.last_share, self.st.buf.keys.device)


def masses(probe: Probe) -> dict[int, torch.Tensor]:
    """The probe's masses, layer -> `[S]` (`Decoder.probe`): those `run_probes` left, else run now."""
    st = probe.st
    found = st.probed.pop(probe.key, None)
    if found is not None:
        return found
    return st.decoder.probe(st.buf, st.question_ids, st.question_slots, layers=probe.layers, weights=probe.weights())


def run_probes(probes: Sequence[Probe]) -> None:
    """Run probes of distinct requests of one decoder, those reading the same layers as one pass
    (`Decoder.probe_batch`), and leave each one's masses in its `Stitched.probed`."""
    by_layers: dict[tuple[int, ...], list[Probe]] = {}
    for probe in probes:
        by_layers.setdefault(probe.layers, []).append(probe)
    for layers, group in by_layers.items():
        decoder = group[0].st.decoder
        found = decoder.probe_batch([p.st.buf for p in group], [p.st.question_ids for p in group],
                                    [p.st.question_slots for p in group], layers=layers,
                                    weights=[p.weights() for p in group])
        for probe, got in zip(group, found, strict=True):
            probe.st.probed[probe.key] = got


def probe_layers(windows: Sequence[int | None], depths: tuple[float, ...]) -> tuple[int, ...]:
    """Layer indices at relative `depths` (0 = first layer, 1 = last), shallowest first, deduplicated.

    A depth that lands on a sliding-window layer moves down to the deepest full-attention layer at
    or below it (when there is one): a sliding layer's question queries cannot see the chunk tokens
    outside its window, so its attention cannot rank them (Gemma 3 slides 5 layers in 6 with a
    512-token window). Moving down, not up, keeps the probe as cheap as asked for.

    Args:
        windows: per layer, its sliding window or None for full attention (`Decoder.windows`).
    """
    last = len(windows) - 1

    def full_at_or_below(layer: int) -> int:
        below = [i for i in range(layer, -1, -1) if windows[i] is None]
        return below[0] if below else layer  # NOTE: every layer slides (Mistral-style): keep it

    return tuple(sorted({full_at_or_below(round(d * last)) for d in depths}))


def question_weights(question_tokens: int, last_share: float | None, device: torch.device) -> torch.Tensor | None:
    """`[Q]` each question token's weight in the probe's attention sum: `last_share` on the last
    token, the rest split equally over the others (None: every token 1, the paper's plain sum).

    The answer is generated from the last position on: its query is the one whose reading of the
    context the first answer token comes from, and the decoding positions after it read the
    context much as it does. The question's other tokens read it too (their K/V carry what they
    read into the answer), so they keep a say; in the plain sum the last token has 1/Q of it.
    """
    if last_share is None:
        return None
    if question_tokens == 1:
        return torch.ones(1, device=device)
    rest = (1.0 - last_share) / (question_tokens - 1)
    weights = torch.full((question_tokens,), rest, device=device)  # [Q]
    weights[-1] = last_share
    return weights


__all__ = ["Probe", "masses", "probe_layers", "question_weights", "run_probes"]
