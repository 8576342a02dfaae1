"""schedlang.utils.paths: where an output's missing folders would be made, and whether that folder takes files."""

import os

from schedlang.utils.paths import nearest_existing, refuses_new_files


def test_nearest_existing_walks_up_to_a_folder_that_exists(tmp_path):
    assert nearest_existing(tmp_path / "a" / "b" / "page.html") == tmp_path
    (tmp_path / "file").write_text("x")
    assert nearest_existing(tmp_path / "file" / "below") == tmp_path / "file"
    assert nearest_existing(tmp_path) == tmp_path


def test_refuses_new_files_says_why_and_leaves_nothing(tmp_path):
    assert refuses_new_files(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        if os.access(locked, os.W_OK) and os.geteuid() == 0:
            # root writes anywhere the file system lets it; a missing folder gives a reason on every system
            assert refuses_new_files(tmp_path / "missing")
        else:
            assert refuses_new_files(locked)
    finally:
        locked.chmod(0o700)
