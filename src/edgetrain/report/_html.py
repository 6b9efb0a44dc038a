"""The report page: one self-contained HTML file (CSS inline, figures as base64 PNG)."""

from __future__ import annotations

import base64
import html
from typing import Sequence

__all__ = ["page", "table", "figure"]

_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:980px;
color:#222;padding:0 1em}h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.8em;
border-bottom:1px solid #ddd;padding-bottom:.2em}table{border-collapse:collapse;font-size:.88em;margin:.6em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}
tr.recompute td{background:#fff4e0}tr.page td{background:#e8f1ff}.kv td:first-child{text-align:left;
font-weight:600}img{max-width:100%;border:1px solid #eee}.note{color:#666;font-size:.88em}"""


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1,
          row_classes: Sequence[str] | None = None, css: str = "") -> str:
    """An HTML table; the first ``left`` columns are left-aligned."""
    def cell(tag: str, i: int, v: object) -> str:
        attr = ' class="l"' if i < left else ""
        return f"<{tag}{attr}>{html.escape(str(v))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cls = f' class="{row_classes[r]}"' if row_classes else ""
        body.append(f"<tr{cls}>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>")
    klass = f' class="{css}"' if css else ""
    return f"<table{klass}><tr>{head}</tr>{''.join(body)}</table>"


def figure(png: bytes, alt: str, file_name: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'
            f'<p class="note">also written as {html.escape(file_name)}</p>')


def page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """The whole document: ``sections`` are (heading, HTML body) pairs."""
    parts = [f"<h2>{html.escape(h)}</h2>{body}" if h else body for h, body in sections]
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{''.join(parts)}</body></html>\n")
