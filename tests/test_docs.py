"""The documentation builds: quickly here (tutorials rendered, not run), in full in ci/docs.sh (every
tutorial executed, its figures drawn), with the command README.md shows."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_COMMAND = "python -m sphinx -W -b html docs docs/_build"


def test_docs_build_without_running_the_tutorials(tmp_path):
    pytest.importorskip("sphinx_gallery", reason="docs extra not installed (pip install -e '.[docs]')")
    pytest.importorskip("furo", reason="docs extra not installed (pip install -e '.[docs]')")
    work = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", work, ignore=shutil.ignore_patterns("_build", "auto_tutorials"))
    # conf.py points at ../tutorials and .. for the package: mirror that layout
    (tmp_path / "tutorials").symlink_to(ROOT / "tutorials")
    (tmp_path / "schedlang").symlink_to(ROOT / "schedlang")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
                             "-D", "plot_gallery=0", str(work), str(tmp_path / "_build")],
                            capture_output=True, text=True, timeout=300)
    # -W: any warning fails the build (malformed markup in a page or a docstring, an autodoc target that
    # does not import, a page in no toctree); --keep-going lists them all
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "_build" / "api.html").exists()
    assert (tmp_path / "_build" / "auto_tutorials" / "index.html").exists()
    assert not (work / "sg_execution_times.rst").exists()  # nothing is written into the docs sources


def test_ci_builds_the_docs_with_the_command_the_readme_shows():
    script = (ROOT / "ci" / "docs.sh").read_text()
    assert DOCS_COMMAND in script.splitlines(), "ci/docs.sh does not run " + DOCS_COMMAND
    assert (ROOT / "ci" / "docs.sh").stat().st_mode & 0o111, "ci/docs.sh is not executable"
    readme = (ROOT / "README.md").read_text()
    assert DOCS_COMMAND in readme, "README.md does not show the docs command " + DOCS_COMMAND


def _mini_docs(tmp_path, tutorials):
    """docs/'s configuration with an index of only the gallery, over the tutorials given as name -> source."""
    work = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", work, ignore=shutil.ignore_patterns("_build", "auto_tutorials", "*.rst", "guide"))
    (work / "index.rst").write_text("Index\n=====\n\n.. toctree::\n\n   auto_tutorials/index\n")
    (tmp_path / "tutorials").mkdir()
    (tmp_path / "tutorials" / "README.txt").write_text("Tutorials\n=========\n\nSmall ones.\n")
    for name, source in tutorials.items():
        (tmp_path / "tutorials" / name).write_text(textwrap.dedent(source))
    (tmp_path / "schedlang").symlink_to(ROOT / "schedlang")
    command = [sys.executable, "-m", "sphinx", "-W", "-b", "html", "-q", str(work), str(tmp_path / "_build")]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


DRAWS = '''
    """
    Draws
    =====

    A figure, then a drawing with ``_repr_svg_``.
    """

    # %%
    # A matplotlib figure.
    import matplotlib.pyplot as plt

    plt.plot([1, 3, 2])
    plt.show()
    print("plotted")

    # %%
    # A drawing the cell ends with.


    class Drawing:
        def _repr_svg_(self):
            return '<svg xmlns="http://www.w3.org/2000/svg" width="40" height="20"><rect width="40" height="20"/></svg>'


    Drawing()
'''


def test_the_gallery_runs_each_tutorial_and_shows_its_figures(tmp_path):
    pytest.importorskip("sphinx_gallery", reason="docs extra not installed (pip install -e '.[docs]')")
    pytest.importorskip("furo", reason="docs extra not installed (pip install -e '.[docs]')")
    result = _mini_docs(tmp_path, {"01_draws.py": DRAWS})
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "_build" / "auto_tutorials" / "01_draws.html").read_text()
    assert "plotted" in page  # executed: its printed output is on the page
    images = sorted(p.name for p in (tmp_path / "_build" / "_images").iterdir())
    assert "sphx_glr_01_draws_001.png" in images and "sphx_glr_01_draws_002.svg" in images, images
    assert "sphx_glr_01_draws_001.png" in page and "sphx_glr_01_draws_002.svg" in page
    assert (tmp_path / "docs" / "auto_tutorials" / "images" / "thumb" / "sphx_glr_01_draws_thumb.png").exists()


def test_a_broken_tutorial_fails_the_build_naming_it(tmp_path):
    pytest.importorskip("sphinx_gallery", reason="docs extra not installed (pip install -e '.[docs]')")
    pytest.importorskip("furo", reason="docs extra not installed (pip install -e '.[docs]')")
    broken = '''
        """
        Broken
        ======
        """

        # %%
        raise RuntimeError("this tutorial is broken")
    '''
    result = _mini_docs(tmp_path, {"02_broken.py": broken})
    assert result.returncode != 0
    assert "02_broken.py" in result.stderr and "this tutorial is broken" in result.stderr, result.stderr[-3000:]
