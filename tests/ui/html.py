"""Reading the viewer's pages in tests without a browser: the rows of its tables (cell texts)
and the text of an element by id (html.parser: what a browser would show, entities decoded)."""

from __future__ import annotations

from html.parser import HTMLParser


class _Rows(HTMLParser):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.rows: list[tuple[str, list[str]]] = []
        self._row: tuple[str, list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr" and found.get(self.key):
            self._row = (str(found[self.key]), [])
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row[1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def table_rows(html: str, key: str = "data-run-id") -> list[tuple[str, list[str]]]:
    """(the row's `key` attribute, its cells' texts) for every <tr> that has the attribute."""
    parser = _Rows(key)
    parser.feed(html)
    return parser.rows


_VOID = frozenset({"br", "hr", "img", "input", "link", "meta", "source", "wbr"})


class _Text(HTMLParser):
    def __init__(self, element_id: str) -> None:
        super().__init__()
        self.element_id = element_id
        self.depth = 0
        self.parts: list[str] = []
        self.found = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _VOID:
            return
        if self.depth:
            self.depth += 1
        elif dict(attrs).get("id") == self.element_id:
            self.depth, self.found = 1, True

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag not in _VOID:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.parts.append(data)


def text_of(html: str, element_id: str) -> str:
    """The text inside the element with that id, whitespace collapsed."""
    parser = _Text(element_id)
    parser.feed(html)
    assert parser.found, f"no element with id {element_id!r}"
    return " ".join("".join(parser.parts).split())
