"""Notes on sampling settings that change what the importance ratio measures, logged at start."""

from __future__ import annotations

from tether.control import AdmissionNote
from tether.vocabulary import SamplingParams


def sampling_notes(params: SamplingParams) -> list[AdmissionNote]:
    """A note when μ, the distribution the engine samples from, is not the trainer's softmax."""
    if not params.truncates:
        return []
    parts = []
    if params.top_k > 0:
        parts.append(f"rollout.top_k={params.top_k}")
    if params.top_p < 1.0:
        parts.append(f"rollout.top_p={params.top_p:g}")
    return [AdmissionNote(
        "truncated_sampling",
        f"{' and '.join(parts)} truncate the sampling distribution: the engine's log-probs are of "
        f"the renormalised truncated distribution μ, while the trainer computes softmax(logits / "
        f"{params.temperature:g}) over the whole vocabulary. Importance ratios π/μ therefore "
        "include the truncation as well as staleness and numerical mismatch.",
    )]
