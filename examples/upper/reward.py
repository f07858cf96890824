"""The reward of the upper-casing example: what `reward.function: path/to/file.py:function` loads.

Tether calls it once per completion, inside the rollout workers, with the prompt, the completion
(special tokens removed), the row's reference answer and the row's other columns as ``fields``.
"""


def reward(prompt: str, completion: str, answer: str, fields: dict) -> float:
    """1 for the exact upper-cased word; otherwise half the share of its letters in place."""
    said = completion.strip()
    if said == answer:
        return 1.0
    word = fields["word"].upper()  # the row's own `word` column, upper-cased
    right = sum(a == b for a, b in zip(said, word, strict=False))  # lengths may differ
    return 0.5 * right / max(len(word), len(said))
