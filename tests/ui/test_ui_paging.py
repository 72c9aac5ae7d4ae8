"""The runs table over 100,000 runs (written in bulk through the store's own append): pages
follow each other exactly, deep pages and filtered pages included, going back returns the
same pages, and the counts are right. (Its speed is benchmarks/ui_runs_page.py's job.)"""

from __future__ import annotations

import html as htmllib
import re
from pathlib import Path

import httpx
import pytest

from fsm_kernel.store import SqliteEventStore
from tests.ui.bulk import REASONS, WORKFLOWS, run_id, write_runs
from tests.ui.conftest import ViewerFactory, base_url
from tests.ui.html import table_rows, text_of

RUNS = 100_000
PAGE = 50


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "runs.db"
    with SqliteEventStore(path) as store:
        write_runs(store, RUNS)
    return path


def link(html: str, rel: str) -> str | None:
    found = re.search(rf'<a id="{rel}" href="([^"]+)"', html)
    return htmllib.unescape(found.group(1)) if found else None


def newest_first(indexes: range | list[int]) -> list[str]:
    return [run_id(i) for i in sorted(indexes, reverse=True)]


def test_paging_through_100000_runs(big_store: Path, serve: ViewerFactory) -> None:
    with httpx.Client(base_url=base_url(serve(store=str(big_store))), timeout=60) as client:
        walk_pages(client)


def walk_pages(client: httpx.Client) -> None:
    first = client.get("/").text
    assert text_of(first, "runs-count") == "100,000 runs"
    assert [r for r, _ in table_rows(first)] == newest_first(range(RUNS - PAGE, RUNS))
    assert link(first, "newer") is None

    pages = [first]
    for _ in range(3):  # older, older, older
        older = link(pages[-1], "older")
        assert older is not None
        pages.append(client.get(older).text)
    for n, page in enumerate(pages):
        top = RUNS - n * PAGE
        assert [r for r, _ in table_rows(page)] == newest_first(range(top - PAGE, top)), n
    back = link(pages[3], "newer")
    assert back is not None
    assert table_rows(client.get(back).text) == table_rows(pages[2])

    deep = client.get(f"/?before={run_id(50_000)}").text  # a cursor halfway down
    assert [r for r, _ in table_rows(deep)] == newest_first(range(50_000 - PAGE, 50_000))
    last = client.get(f"/?before={run_id(30)}").text
    assert [r for r, _ in table_rows(last)] == newest_first(range(30))
    assert link(last, "older") is None
    near_top = client.get(f"/?after={run_id(RUNS - 10)}").text  # fewer than a page above
    assert table_rows(near_top) == table_rows(first)
    assert client.get("/?before=no-such-run").status_code == 404


def test_filtered_pages_of_100000_runs(big_store: Path, serve: ViewerFactory) -> None:
    with httpx.Client(base_url=base_url(serve(store=str(big_store))), timeout=60) as client:
        filter_pages(client)


def filter_pages(client: httpx.Client) -> None:
    react = [i for i in range(RUNS) if WORKFLOWS[i % len(WORKFLOWS)] == "react"]
    done = [i for i in range(RUNS) if i % 4 and REASONS[i % 4] == "done"]
    running = [i for i in range(RUNS) if i % 4 == 0]

    page = client.get("/?workflow=react").text
    assert text_of(page, "runs-count") == f"{len(react):,} runs match"
    assert [r for r, _ in table_rows(page)] == newest_first(react[-PAGE:])
    older = link(page, "older")
    assert older is not None
    assert "workflow=react" in older
    assert [r for r, _ in table_rows(client.get(older).text)] == newest_first(
        react[-2 * PAGE : -PAGE]
    )
    page = client.get("/?status=done&workflow=react").text
    both = sorted(set(react) & set(done))
    assert text_of(page, "runs-count") == f"{len(both):,} runs match"
    assert [r for r, _ in table_rows(page)] == newest_first(both[-PAGE:])
    rows = table_rows(client.get("/?status=interrupted").text)  # no process drives them
    assert [r for r, _ in rows] == newest_first(running[-PAGE:])
    assert {cells[2] for _, cells in rows} == {"interrupted"}
    assert table_rows(client.get("/?status=running").text) == []
    assert {cells[4] for _, cells in rows} == {f"{120 + i % 7}" for i in running[-PAGE:]}
    page = client.get("/?q=task+number+4242").text  # a substring of the goal
    assert [r for r, _ in table_rows(page)] == newest_first([4242, *range(42420, 42430)])
