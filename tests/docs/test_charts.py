"""The docs' charts (docs/hooks.py `with_charts`) are drawn from the tables beside them."""

from __future__ import annotations

import re
from types import ModuleType

PAGE = """Intro.

<!-- chart: Time per iteration, µs | columns=1 -->
| contender | µs | KiB |
|---|---:|---:|
| fsm-kernel, no store | 200 | — |
| `LangGraph` | 400 | 12 |
| Burr | 1,000 [900 / 1,100] | — |

After.
"""


def bars(svg: str) -> list[tuple[float, str]]:
    return [
        (float(w), colour)
        for w, colour in re.findall(
            r'<rect x="250" y="\d+" width="([\d.]+)" height="16" fill="(#\w+)"', svg
        )
    ]


def test_a_cell_gives_its_first_number(hooks: ModuleType) -> None:
    assert hooks.chart_value("2,433 [1,736 / 2,433 / 3,157]") == 2433.0
    assert hooks.chart_value("0.94× (0.99×)") == 0.94
    assert hooks.chart_value("—") is None


def test_the_chart_follows_its_table_with_bars_to_scale(hooks: ModuleType) -> None:
    out = hooks.with_charts(PAGE)

    table_end = out.index("| Burr | 1,000 [900 / 1,100] | — |")
    chart = out.index('<div class="chart">')
    assert table_end < chart < out.index("After.")
    svg = out[chart:]
    assert "<title>Time per iteration, µs</title>" in svg
    widths = [w for w, _ in bars(svg)]
    assert widths == [66.0, 132.0, 330.0]  # 200 : 400 : 1,000 of the longest bar's 330 px
    assert [c for _, c in bars(svg)] == ["#3f51b5", "#9e9e9e", "#9e9e9e"]  # ours in colour
    assert ">LangGraph<" in svg  # backticks dropped from labels


def test_several_columns_are_grouped_bars_with_a_legend(hooks: ModuleType) -> None:
    out = hooks.with_charts(PAGE.replace("columns=1", "columns=1,2"))

    svg = out[out.index("<svg") :]
    assert ">µs</text>" in svg  # the legend names the headers
    assert ">KiB</text>" in svg
    widths = [w for w, _ in bars(svg)]
    assert widths == [66.0, 132.0, 4.0, 330.0]  # no bar where a cell holds no number


def test_a_page_without_a_chart_is_left_alone(hooks: ModuleType) -> None:
    page = PAGE.replace("<!-- chart: Time per iteration, µs | columns=1 -->\n", "")
    assert hooks.on_page_markdown(page, None, None, None) == page
