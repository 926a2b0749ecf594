"""Links and title of an HTML page, with the standard library's tolerant parser."""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import urldefrag, urljoin, urlsplit

__all__ = ["parse_page"]


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.hrefs: list[str] = []
        self.title_parts: list[str] = []
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title_parts.append(data)


def parse_page(base_url: str, html: str, *, same_host: bool = True) -> tuple[str, list[str]]:
    """``(title, links)`` of a page: absolute http(s) links, fragments dropped, in page order,
    without repeats; only links on ``base_url``'s host and port when ``same_host``."""
    collector = _Collector()
    collector.feed(html)
    collector.close()
    base_netloc = urlsplit(base_url).netloc
    seen: set[str] = set()
    links: list[str] = []
    for href in collector.hrefs:
        url = urldefrag(urljoin(base_url, href.strip())).url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or (same_host and parts.netloc != base_netloc):
            continue
        if url not in seen:
            seen.add(url)
            links.append(url)
    return " ".join("".join(collector.title_parts).split()), links
