"""The staleness study a run contains: how clipping and the ratio spread grow with staleness.

With a deep budget and no idle syncs, one run sweeps staleness by itself (at S the batch trained
at step i is (i − 1) mod (S + 1) batches stale), so the seed system's by-hand study is a view of
the run's own metrics (``tether report`` writes it as ``plots/study.json`` and ``study.png``):

- per staleness value: batches, and the mean and standard deviation of the clip fraction (low +
  high: the clips that bind), the seed's and Flow-GRPO's clip fraction (``outside_clip_frac``:
  |π_θ/μ − 1| > ε against the behaviour policy whatever the anchor,
  ``ratio/behavior_outside_clip_frac``), the ratio spread (``ratio/std``) and the
  importance-weight spread (``ratio/is_weight_std``, π_old/μ: where staleness shows with
  ``train.anchor: proximal`` and one update per batch);
- the grouped comparison: batches at or below the median staleness against those above it (or,
  with ``low``/``high``, batches at most ``low`` against those at least ``high``, the middle left
  out, as the seed compared ≤ 2 with ≥ 7), each figure's difference with its standard error, t,
  degrees of freedom (Welch–Satterthwaite) and two-sided p-value;
- the reward trend: the least-squares slope of ``reward/mean`` per trained batch, its standard
  error and t-statistic (t = slope / se; |t| > 2 is a trend the noise is unlikely to make).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

FIGURES = {"clip_frac": ("ratio/clip_frac_low", "ratio/clip_frac_high"),
           "outside_clip_frac": ("ratio/behavior_outside_clip_frac",), "ratio_std": ("ratio/std",),
           "is_weight_std": ("ratio/is_weight_std",)}


def _value(row: dict[str, Any], keys: Sequence[str]) -> float | None:
    values = [row.get(k) for k in keys]
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    return float(sum(values))


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


def _describe(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    mean, std = _mean_std(values)
    return {"n": len(values), "mean": mean, "std": std}


def trend(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares slope of ys on xs with its standard error and t-statistic."""
    n = len(xs)
    if n < 3:
        return {"n": n}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return {"n": n}
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(residual / (n - 2) / sxx)
    return {"n": n, "slope": slope, "intercept": my - slope * mx, "se": se,
            "t": slope / se if se > 0 else math.inf}


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (Lentz's
    method; the symmetry I_x(a, b) = 1 − I_{1−x}(b, a) keeps x where it converges fast)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log(1 - x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-14:
            break
    return front * (f - 1.0)


def two_sided_p(t: float, df: float) -> float:
    """P(|T| ≥ |t|) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def _compare(low: list[float], high: list[float]) -> dict[str, float]:
    out = {"low": _describe(low), "high": _describe(high)}
    if len(low) > 1 and len(high) > 1:
        (ml, sl), (mh, sh) = _mean_std(low), _mean_std(high)
        vl, vh = sl * sl / len(low), sh * sh / len(high)
        se = math.sqrt(vl + vh)
        out["difference"] = mh - ml
        out["se"] = se
        out["t"] = (mh - ml) / se if se > 0 else (0.0 if mh == ml else math.inf)
        if se > 0:  # Welch–Satterthwaite
            out["df"] = (vl + vh) ** 2 / (vl * vl / (len(low) - 1) + vh * vh / (len(high) - 1))
            out["p"] = two_sided_p(out["t"], out["df"])
    return out


def staleness_study(metrics: list[dict[str, Any]], *, low: float | None = None,
                    high: float | None = None) -> dict[str, Any]:
    """The study of a run's metrics rows (see the module's docstring); ``low`` and ``high`` (both
    or neither) group staleness ≤ low against ≥ high instead of the median split."""
    if (low is None) != (high is None) or (low is not None and high is not None and high <= low):
        from tether.errors import ConfigError

        raise ConfigError(f"the study's groups need both a low and a high staleness, high above low; got "
                          f"low={low}, high={high}")
    rows = [m for m in metrics if m.get("staleness/batches") is not None]
    levels = sorted({float(m["staleness/batches"]) for m in rows})
    by_staleness = {}
    for level in levels:
        at = [m for m in rows if float(m["staleness/batches"]) == level]
        by_staleness[f"{level:g}"] = {"batches": len(at), **{
            name: _describe([v for m in at if (v := _value(m, keys)) is not None])
            for name, keys in FIGURES.items()}}
    ordered = sorted(float(m["staleness/batches"]) for m in rows)
    median = ordered[(len(ordered) - 1) // 2] if ordered else 0.0
    if low is None:
        grouped: dict[str, Any] = {"median_staleness": median}
        is_low, is_high = (lambda st: st <= median), (lambda st: st > median)
    else:
        grouped = {"low_staleness": low, "high_staleness": high}
        is_low, is_high = (lambda st: st <= low), (lambda st: st >= high)
    for name, keys in FIGURES.items():
        pairs = [(float(m["staleness/batches"]), _value(m, keys)) for m in rows]
        grouped[name] = _compare([v for st, v in pairs if is_low(st) and v is not None],
                                 [v for st, v in pairs if is_high(st) and v is not None])
    rewarded = [m for m in metrics if m.get("reward/mean") is not None and m.get("step") is not None]
    steps, rewards = [float(m["step"]) for m in rewarded], [float(m["reward/mean"]) for m in rewarded]
    return {"by_staleness": by_staleness, "grouped": grouped, "reward_trend": trend(steps, rewards)}


def summary_lines(study: dict[str, Any]) -> list[str]:
    """The study in a few printable lines: per staleness the clip fractions (binding; against the
    behaviour policy, the seed's measure), the ratio spread and the importance-weight spread; each
    grouped comparison with its t and p; the reward trend."""
    lines = []
    for level, row in study["by_staleness"].items():
        clip = row["clip_frac"]
        if clip.get("n"):
            figures = [f"clip fraction {clip['mean']:.4f} ± {clip['std']:.4f}"]
            outside, weights = row.get("outside_clip_frac", {}), row.get("is_weight_std", {})
            if outside.get("n"):
                figures.append(f"outside the clip vs μ {outside['mean']:.4f} ± {outside['std']:.4f}")
            figures.append(f"ratio std {row['ratio_std'].get('mean', float('nan')):.2e}")
            if weights.get("n"):
                figures.append(f"IS weight std {weights['mean']:.2e}")
            lines.append(f"staleness {level}: {row['batches']} batches, " + ", ".join(figures))
    grouped = study["grouped"]
    if "median_staleness" in grouped:
        which = f"above vs at-or-below median staleness {grouped['median_staleness']:g}"
    else:
        which = f"staleness ≥ {grouped['high_staleness']:g} vs ≤ {grouped['low_staleness']:g}"
    for name, label in (("clip_frac", "clip fraction"), ("outside_clip_frac", "outside the clip vs μ"),
                        ("is_weight_std", "IS weight std")):
        g = grouped.get(name, {})
        if "t" in g:
            tail = f", df = {g['df']:.1f}, p = {g['p']:.2g}" if "p" in g else ""
            lines.append(f"{label} {which}: {g['difference']:+.4f} ± {g['se']:.4f} (t = {g['t']:.2f}{tail})")
    r = study["reward_trend"]
    if "t" in r:
        lines.append(f"reward trend: {r['slope']:+.2e} per batch ± {r['se']:.1e} "
                     f"(t = {r['t']:.2f}, n = {r['n']})")
    return lines
