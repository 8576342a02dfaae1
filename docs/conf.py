"""Sphinx configuration: the tutorial gallery (sphinx-gallery, every tutorial executed) and the API reference.

Build it as CI does (``ci/docs.sh``)::

    python -m sphinx -W -b html docs docs/_build

Every tutorial runs during the build; a tutorial that raises fails the build, and so does any warning
(``-W``). ``-D plot_gallery=0`` renders the pages without running them (fast, no outputs or figures);
``SCHEDLANG_GALLERY_PATTERN=/11_`` runs only the tutorials whose path matches (the others are rendered without
outputs), to check one page quickly.
"""

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(DOCS / "_ext"))  # gallery_svg, named below by module path: Sphinx caches the config
os.environ.setdefault("TRITON_INTERPRET", "1")  # tutorials that launch Triton kernels run on CPU builders too

# transformers imports torchao whenever it is installed; on a CPU build of torch torchao logs that its CUDA
# extensions failed to load, which the gallery would capture into the pages of every tutorial that builds an HF
# model. The same filters as `schedlang train` and the launched ranks use (kept at debug).
from schedlang.quiet_imports import quiet_torchao_import  # noqa: E402

quiet_torchao_import()

project = "schedlang"
author = "schedlang developers"
copyright = "2026, schedlang developers"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
]
autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_mock_imports = ["triton"]


sphinx_gallery_conf = {
    "examples_dirs": ["../tutorials"],
    "gallery_dirs": ["auto_tutorials"],
    "filename_pattern": os.environ.get("SCHEDLANG_GALLERY_PATTERN", r"/\d\d_"),  # execute every numbered tutorial
    "abort_on_example_error": True,  # a tutorial that raises stops the build, naming the tutorial
    "image_scrapers": ("matplotlib", "gallery_svg.svg_scraper"),
    "capture_repr": ("_repr_html_",),  # printed output is shown; bare expressions only as drawings
    "thumbnail_size": (400, 280),
    "remove_config_comments": True,
    "download_all_examples": False,
    "within_subsection_order": "FileNameSortKey",
    "write_computation_times": False,  # no sg_execution_times.rst written into docs/
    "show_memory": False,
    "matplotlib_animations": False,
}

html_theme = "furo"
html_title = "schedlang"
html_static_path = ["_static"]
html_css_files = ["schedlang.css"]
exclude_patterns = ["_build"]
