"""The progress display: plain lines off a terminal, a two-line live display on one."""

import io

from tether.runtime.progress import Progress


def test_plain_lines_show_the_figures_and_the_last_step():
    out = io.StringIO()
    with Progress(10, "train", fields=("reward", "staleness"), stream=out, plain=True, every_s=3600) as p:
        for step in range(1, 11):
            p.update(step, {"reward": 0.25 * (step % 3), "staleness": 1, "ignored": 5})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first update, then the last step (the interval never elapses)
    assert lines[-1].startswith("train: 10/10  reward 0.25  staleness 1")
    assert "ignored" not in lines[-1] and "ETA" in lines[-1]


def test_terminal_display_puts_bar_and_eta_first_and_figures_below():
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    p = Progress(100, "train", fields=("reward",), plain=False, console=console)
    p.update(40, {"reward": 0.5})
    console.print(*p._rich.get_renderables())
    first, second = buf.getvalue().rstrip().splitlines()[:2]
    assert first.startswith("train") and "40/100" in first and "ETA" in first
    assert second.strip() == "reward 0.5"
    p.close()


def test_work_that_may_stop_early_shows_its_eta_as_a_bound():
    out = io.StringIO()
    with Progress(100, "warm start", fields=("loss",), stream=out, plain=True, eta_label="at most") as p:
        p.update(10, {"loss": 1.5})
    line = out.getvalue().splitlines()[-1]
    assert "at most" in line and "ETA" not in line
