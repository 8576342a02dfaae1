"""A sphinx-gallery image scraper for drawings a cell ends with, shown as a notebook would show them.

A cell whose last line is an expression with a ``_repr_svg_`` method (the method Jupyter displays)
gets that SVG as its figure, saved beside the matplotlib figures; when it is a page's first figure it
is also the page's thumbnail. Tutorial 02 shows the graphs ``schedlang.report`` draws this way.
"""

import ast
from pathlib import Path

from sphinx_gallery.scrapers import figure_rst


def svg_scraper(block, block_vars, gallery_conf):
    try:
        statements = ast.parse(block.content).body
    except SyntaxError:
        return ""
    if not statements or not isinstance(statements[-1], ast.Expr):
        return ""  # ``___`` below would then be the value some earlier cell ended with
    shown = block_vars["fake_main"].__dict__.get("___")
    render = getattr(shown, "_repr_svg_", None)
    if render is None:
        return ""
    path = Path(next(block_vars["image_path_iterator"])).with_suffix(".svg")
    path.write_text(render(), encoding="utf-8")
    return figure_rst([str(path)], gallery_conf["src_dir"])
