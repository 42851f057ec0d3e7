"""What a run's measurements say about its batch size, in two lines: the tokens per step that take the fewest steps
and the one that takes the fewest tokens, and their ratio (``bigbatch plan --from-run``).

Measured by branching (``bigbatch critical-batch``), the fewest steps to a loss come from the critical batch (the
largest size whose loss after the same tokens stays within the tolerance: larger steps buy no fewer steps), the
fewest tokens from the size whose loss after those tokens was lowest. Without a measurement, the noise scale's model
(McCandlish et al., 2018: steps ``S = S_min (1 + B_noise / B)``, tokens ``E = E_min (1 + B / B_noise)``) puts
each within 10% of its minimum at ``10 x`` and ``B_noise / 10``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bigbatch.files.json_text import from_json


def newest_measurement(run_dir: Path) -> dict[str, Any] | None:
    """The ``result.json`` of RUN's critical-batch measurement from its latest branch point, or ``None``."""
    found = []
    for path in (run_dir / "critical-batch").glob("step_*/result.json"):
        try:
            data = from_json(path.read_text())
            found.append((int(data["parent_step"]), path.stat().st_mtime, data))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(found, key=lambda item: item[:2])[2] if found else None


def tradeoff_lines(run_dir: Path, noise_scale: float) -> list[str]:
    """Two lines: the steps-minimising and the tokens-minimising tokens per step, and their ratio."""
    measured = newest_measurement(run_dir)
    if measured is not None and measured.get("branches"):
        branches = measured["branches"]
        critical = int(measured["critical_tokens_per_step"])
        best = min(branches, key=lambda b: float(b["val_loss"]))
        fewest_tokens = int(best["tokens_per_step"])
        tolerance, budget = float(measured["tolerance"]), int(measured["budget"])
        bound = {"at least": "at least ", "at most": "at most "}.get(str(measured.get("bound")), "")
        return [
            f"fewest steps: {bound}{critical:,} tokens/step, the critical batch measured by branching at step "
            f"{measured['parent_step']:,}: the largest size whose loss after {budget:,} tokens stays within "
            f"{tolerance:.1%} of the smallest's (larger steps take no fewer steps to that loss)",
            f"fewest tokens: {fewest_tokens:,} tokens/step, the size with the lowest loss after those tokens "
            f"({float(best['val_loss']):.4f}); ratio {critical / fewest_tokens:.3g}x: the steps-minimising size takes "
            f"{critical / fewest_tokens:.3g}x fewer steps for the same tokens",
        ]
    many, few = 10 * noise_scale, noise_scale / 10
    return [
        f"fewest steps: about {many:,.0f} tokens/step (10x the noise scale: steps within 10% of the fewest, as "
        "S = S_min (1 + B_noise/B) has it; bigbatch critical-batch RUN measures it instead)",
        f"fewest tokens: about {few:,.0f} tokens/step (the noise scale / 10: tokens within 10% of the fewest, "
        "E = E_min (1 + B/B_noise)); ratio 100x (the model's: at the noise scale itself each is 2x its minimum)",
    ]
