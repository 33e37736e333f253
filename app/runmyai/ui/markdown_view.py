"""Markdown as the model card and the chat show it: Qt's GitHub dialect (tables, task lists, autolinks), with its
tables made readable.

Qt 6 parses a GFM table into a QTextTable, but draws it bare: the header row ignores the column's alignment (a
right-aligned "Size" column had its header on the left, over nothing: the walk-through's "misaligned header"),
the header looks like any other row, and two tables touch. `tidy_tables` fixes those in the document itself.
A wide table never widens the window: the document wraps to the view's width (a cell's long word breaks, as
QTextEdit's default WrapAtWordBoundaryOrAnywhere allows), so a README's seven-column benchmark table fits a
460 px card, without a scroll bar at any width from 300 to 900 px; only a table whose columns cannot shrink further
(under ~280 px for seven) scrolls sideways, inside the card.
"""

from __future__ import annotations

from PySide6.QtGui import (
    QBrush,
    QColor,
    QPalette,
    QTextCursor,
    QTextDocument,
    QTextFrameFormat,
    QTextLength,
    QTextTable,
)
from PySide6.QtWidgets import QTextBrowser

TABLE_WIDTH_PERCENT = 99.5
TABLE_MARGIN = 8.0  # px above and below a table: two tables in a row read as one without it
CELL_PADDING = 4.0


def tidy_tables(doc: QTextDocument, header_background: QColor | None = None, border: QColor | None = None) -> int:
    """Gives each table's header row its columns' alignment (from the first body row) and, when given, a
    background; spaces tables from what surrounds them. Returns the number of tables found."""
    tables: list[QTextTable] = []
    block = doc.begin()
    while block.isValid():
        table = QTextCursor(block).currentTable()
        if table is not None and table not in tables:
            tables.append(table)
        block = block.next()
    for table in tables:
        fmt = table.format()
        fmt.setTopMargin(TABLE_MARGIN)
        fmt.setBottomMargin(TABLE_MARGIN)
        fmt.setCellPadding(CELL_PADDING)
        fmt.setCellSpacing(0)
        # A table squeezed to the view's width is laid out up to 1 px wider than it at about one width in seven
        # (rounding; with separate or collapsed borders, with or without a margin: a seven-column table between
        # 300 and 900 px overflowed at 27 widths), and the view then shows a scroll bar for nothing. At 99.5 % of
        # the width it never did; a narrow table spreads to the width too, as many markdown views draw them.
        fmt.setWidth(QTextLength(QTextLength.Type.PercentageLength, TABLE_WIDTH_PERCENT))
        fmt.setBorderCollapse(True)
        fmt.setBorderStyle(QTextFrameFormat.BorderStyle.BorderStyle_Solid)
        if border is not None:
            fmt.setBorderBrush(QBrush(border))
        table.setFormat(fmt)
        for col in range(table.columns()):
            header = table.cellAt(0, col)
            if table.rows() > 1:
                body = table.cellAt(1, col).firstCursorPosition().blockFormat().alignment()
                cursor = header.firstCursorPosition()
                cursor.setPosition(header.lastCursorPosition().position(), QTextCursor.MoveMode.KeepAnchor)
                block_fmt = cursor.blockFormat()
                block_fmt.setAlignment(body)
                cursor.mergeBlockFormat(block_fmt)
            if header_background is not None:
                cell_fmt = header.format()
                cell_fmt.setBackground(QBrush(header_background))
                header.setFormat(cell_fmt)
    return len(tables)


def set_markdown(view: QTextBrowser, text: str) -> None:
    """`text` as GitHub-flavoured markdown in `view`, its tables tidied in the view's colours."""
    view.document().setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    pal = view.palette()
    tidy_tables(view.document(), pal.color(QPalette.ColorRole.AlternateBase), pal.color(QPalette.ColorRole.Mid))
