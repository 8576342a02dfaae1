"""Sphinx configuration: the tutorial gallery (sphinx-gallery) and the API reference (autodoc)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("TRITON_INTERPRET", "1")  # tutorials that launch Triton kernels run on CPU builders too

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
    "filename_pattern": r"/\d\d_",
    "download_all_examples": False,
    "within_subsection_order": "FileNameSortKey",
    "write_computation_times": False,  # no sg_execution_times.rst written into docs/
}

html_theme = "alabaster"
exclude_patterns = ["_build"]
