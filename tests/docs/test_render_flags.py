"""docs/guide/render_flags.py: the trainer page's flag table is the trainer's parser, flag for flag."""

import importlib.util
import re
from pathlib import Path

import pytest

from schedlang.train.flags import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def render_flags():
    spec = importlib.util.spec_from_file_location("render_flags", ROOT / "docs" / "guide" / "render_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trainer_page_is_current(render_flags):
    assert render_flags.main(["--check"]) == 0, "run python docs/guide/render_flags.py"


def test_every_flag_of_the_parser_has_a_row(render_flags):
    text = render_flags.section(build_parser())
    typed = re.findall(r"^   \* - ``([^`]*)``$", text, flags=re.M)  # e.g. "--dtype {fp32,bf16}", "-h, --help"
    spellings = {word for row in typed for word in row.replace(",", " ").split() if word.startswith("-")}
    assert spellings == {o for a in build_parser()._actions for o in a.option_strings}
    assert "``--dtype {fp32,bf16}``" in text and "``--resume``" in text and "``--init-from DIR``" in text


def test_a_changed_flag_makes_the_page_stale(render_flags, tmp_path, monkeypatch):
    page = tmp_path / "trainer.rst"
    page.write_text("Trainer\n=======\n\n.. flag-table:start\n.. flag-table:end\n\nAfter.\n")
    assert render_flags.main(["--page", str(page), "--check"]) == 1
    assert render_flags.main(["--page", str(page)]) == 0
    assert render_flags.main(["--page", str(page), "--check"]) == 0
    text = page.read_text()
    assert text.endswith(".. flag-table:end\n\nAfter.\n")
    # help text reads literally: markup characters are escaped, and the flags it names are literals (Sphinx would
    # turn a bare "--" into a dash)
    assert "model\\_type" in text and "with ``--config`` tiny" in text
    parser = build_parser()
    parser.add_argument("--a-new-flag", action="store_true", help="one the page does not have yet")
    assert "--a-new-flag" in render_flags.section(parser) and "--a-new-flag" not in text


def test_missing_markers_are_named(render_flags, tmp_path):
    page = tmp_path / "trainer.rst"
    page.write_text("Trainer\n=======\n")
    with pytest.raises(SystemExit, match="markers .. flag-table:start ... .. flag-table:end not found"):
        render_flags.main(["--page", str(page)])
