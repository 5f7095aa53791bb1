"""The report's page: a list of blocks, rendered twice, as Markdown (plots linked from ``figures/``) and as one
self-contained HTML file (plots embedded as data URIs; text from settings and files escaped, and only http(s) and
relative links made links).

The blocks: ("h", level, text), ("p", text), ("table", rows), ("img", file name under figures/, caption). Text may
hold `code`, **bold** and [label](link).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from tasks.tables import markdown_table


class Page:
    def __init__(self) -> None:
        self.blocks: list[tuple] = []
        self.figures: dict[str, Path] = {}  # name under figures/ → source file

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.blocks.append(("table", rows))

    def figure(self, source: Path, name: str, caption: str) -> None:
        self.figures[name] = source
        self.blocks.append(("img", name, caption))

    def document(self, file: str, summary: str, markdown: str) -> None:
        """A Markdown document beside the report (``file``): linked from report.md, embedded in report.html
        (folded under ``summary``), so the HTML page needs nothing beside it."""
        self.blocks.append(("doc", file, summary, markdown))


def _number(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"


def as_text(value: Any) -> str:
    if value is None:
        return ""
    return _number(value) if isinstance(value, float) else str(value)


def to_markdown(title: str, page: Page) -> str:
    lines = [f"# {title}", ""]
    for block in page.blocks:
        if block[0] == "h":
            lines += ["#" * (block[1] + 1) + " " + block[2], ""]
        elif block[0] == "p":
            lines += [block[1], ""]
        elif block[0] == "table":
            lines += [*markdown_table(block[1], number=_number).splitlines(), ""]
        elif block[0] == "img":
            lines += [f"![{block[2]}](figures/{block[1]})", ""]
        elif block[0] == "doc":
            lines += [f"{block[2]}: [{block[1]}]({block[1]}).", ""]
    return "\n".join(lines)


# One inline markup span, the first to start wins: `code`, **bold** or [label](link).
_INLINE = re.compile(r"`([^`]+)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")


_HTTP_LINK = re.compile(r"https?://[^\s\"'<>`\\\x00-\x1f\x7f]+", re.IGNORECASE)


_RELATIVE_LINK = re.compile(r"[\w.~/#?&=%+-]+", re.ASCII)  # no scheme: no colon, no control characters


def _link_allowed(link: str) -> bool:
    """http(s) links and relative links (``baseline_cases.md``); never ``javascript:``, ``data:`` and the like."""
    return bool(_HTTP_LINK.fullmatch(link) or _RELATIVE_LINK.fullmatch(link))


def _inline_html(text: str) -> str:
    """``text`` as HTML: everything escaped; `code` (its content literal), **bold** and [label](link) marked
    up, a link only when :func:`_link_allowed` (else the markdown shows as plain text)."""
    parts, at = [], 0
    for m in _INLINE.finditer(text):
        parts.append(html.escape(text[at : m.start()], quote=False))
        at = m.end()
        if m[1] is not None:
            parts.append(f"<code>{html.escape(m[1], quote=False)}</code>")
        elif m[2] is not None:
            parts.append(f"<strong>{_inline_html(m[2])}</strong>")
        elif _link_allowed(m[4]):
            parts.append(f'<a href="{html.escape(m[4])}">{_inline_html(m[3])}</a>')
        else:
            parts.append(html.escape(m[0], quote=False))
    return "".join(parts) + html.escape(text[at:], quote=False)


_FENCE = re.compile(r"^(`{3,}|~{3,})")


def markdown_html(text: str) -> str:
    """The Markdown the project writes (a case report: headings, tables, paragraphs, fenced code of any
    fence length) as HTML, every text escaped; inline `code`, **bold** and links as :func:`_inline_html`."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            marker, body = fence[1], []
            i += 1
            while i < len(lines) and not (
                lines[i].startswith(marker[0] * len(marker)) and set(lines[i].strip()) == {marker[0]}
            ):
                body.append(lines[i])
                i += 1
            out.append("<pre><code>" + html.escape("\n".join(body), quote=False) + "</code></pre>")
        elif line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")), 6)
            out.append(f"<h{level}>{_inline_html(line[level:].strip())}</h{level}>")
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip().strip("|"))])
                i += 1
            i -= 1
            body_rows = [r for r in rows[1:] if not all(set(c) <= {"-", ":"} for c in r)]
            head = "".join(f"<th>{_inline_html(c)}</th>" for c in rows[0])
            cells = "".join("<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in r) + "</tr>" for r in body_rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
        elif line.strip():
            paragraph = [line]
            while i + 1 < len(lines) and lines[i + 1].strip() and not re.match(r"^(#|\||`{3,}|~{3,})", lines[i + 1]):
                i += 1
                paragraph.append(lines[i])
            out.append(f"<p>{_inline_html(' '.join(paragraph))}</p>")
        i += 1
    return "\n".join(out)


def to_html(title: str, page: Page, figures_dir: Path) -> str:
    """The page as one HTML file, plots embedded as data URIs (it reads the same anywhere it is copied)."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for block in page.blocks:
        if block[0] == "h":
            body.append(f"<h{block[1] + 1}>{_inline_html(block[2])}</h{block[1] + 1}>")
        elif block[0] == "p":
            body.append(f"<p>{_inline_html(block[1])}</p>")
        elif block[0] == "table":
            header = list(dict.fromkeys(k for row in block[1] for k in row))
            cells = "".join(f"<th>{html.escape(k)}</th>" for k in header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(as_text(row.get(k)))}</td>" for k in header) + "</tr>"
                for row in block[1]
            )
            body.append(f"<table><thead><tr>{cells}</tr></thead><tbody>{rows}</tbody></table>")
        elif block[0] == "img":
            data = base64.b64encode((figures_dir / block[1]).read_bytes()).decode()
            body.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(block[2])}">'
                f"<figcaption>{html.escape(block[2])} "
                f"(<code>figures/{html.escape(block[1])}</code>)</figcaption></figure>"
            )
        elif block[0] == "doc":
            anchor = html.escape(block[1].rsplit(".", 1)[0].replace("_", "-"))
            body.append(
                f'<details id="{anchor}"><summary>{_inline_html(block[2])} '
                f'(<code>{html.escape(block[1])}</code>)</summary>\n<div class="doc">'
                + markdown_html(block[3])
                + "</div></details>"
            )
    style = (
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;line-height:1.45}"
        "table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.2rem .6rem;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%}figure{margin:1rem 0}figcaption{color:#555;font-size:.9rem}"
        "code{background:#f3f3f3;padding:0 .2rem}"
        "details{margin:1rem 0;border:1px solid #ddd;padding:.4rem .8rem}summary{cursor:pointer;font-weight:600}"
        "pre{background:#f6f6f6;padding:.5rem;overflow-x:auto;white-space:pre-wrap}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
