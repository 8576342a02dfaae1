"""The HTML report: every section filled from the schedule, self-contained, and rendered by a real
headless browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import schedlang
import schedlang.verify
from schedlang.distributed.launch import run_distributed
from schedlang.report import SECTIONS, collect, render
from tests.helpers.hf_models import llama



def _swiglu(g, u):
    return F.silu(g) * u


def _tiny_llama():
    return llama(0, attn=None, intermediate_size=96, num_key_value_heads=2, vocab_size=128,
                 max_position_embeddings=64)


def _scheduled(world_tp: bool = False):
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        if world_tp:
            from schedlang.models import shard_model

            shard_model(sch, gather_logits=True)
        mlp = sch["model.layers.0.mlp"]
        mlp.trace(flatten=True)
        mlp.fuse(mlp.find(_swiglu), compiler="eager", name="SwiGLU")
        sch["model.layers.1"].checkpoint()
    model, _ = schedlang.build(sch)
    return sch, model, check


def test_every_section_is_filled_from_the_schedule():
    sch, model, check = _scheduled()
    data = collect(sch, model=model, verify_report=check.report)
    assert [p["primitive"] for p in data.plan] == ["trace", "fuse", "checkpoint"]
    tree = {r["path"]: r for r in data.tree}
    assert tree["model.layers.0.mlp"]["type_before"] == "LlamaMLP" and tree["model.layers.0.mlp"]["steps"] == [0, 1]
    assert "activations recomputed in backward" in tree["model.layers.1"]["notes"]
    assert tree["model.layers.0.mlp.SwiGLU_0"]["type_before"] == "(new)"
    (graph,) = data.graphs
    before = {n["label"] for n in graph["before"]}
    after = {n["label"] for n in graph["after"]}
    assert {"silu", "mul"} <= before and not {"silu", "mul"} & after and "SwiGLU_0" in after
    assert [n["fused"] for n in graph["after"] if n["label"] == "SwiGLU_0"] == [True]
    (kernel,) = data.kernels
    assert kernel["name"] == "SwiGLU_0" and "silu" in kernel["source"]
    assert data.ranks[0]["parameters"] == sum(p.numel() for p in model.parameters())
    assert data.verify["passed"] and data.verify["compared"]
    page = render(data)
    for key, title in SECTIONS:
        assert f'<section id="{key}"><h2>{title}</h2>' in page
    assert page.count("<svg") == 2
    # self-contained: nothing fetched, no script
    assert not re.search(r"(src|href)=\"(https?:)?//", page) and "<script" not in page


def test_a_failed_verify_shows_as_failed():
    model = _tiny_llama()
    sch = schedlang.create_schedule(model)
    data = collect(sch, verify_report=schedlang.verify.VerifyReport(compared=["out"], mismatches=["out: off by 3"]))
    page = render(data)
    assert "Verify FAILED" in page and "off by 3" in page
    assert "The plan is empty" in page and "No subgraph was fused" in page


def _report_two_ranks(rank, world, path):
    sch, model, check = _scheduled(world_tp=True)
    written = sch.report(path, model=model, verify=check)
    return written


def test_tensor_parallel_report_has_a_row_per_rank(tmp_path):
    path = str(tmp_path / "tp.html")
    written = run_distributed(_report_two_ranks, world_size=2, args=(path,), timeout=180)
    assert written == [path, None]  # rank 0 writes
    page = open(path).read()
    rows = re.findall(r"<tr><td class=\"num\">(\d)</td>", page.split('id="ranks"')[1].split("</table>")[0])
    assert rows == ["0", "1"]
    assert "split on axis" in page and "Verify passed" in page


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("SCHEDLANG_REQUIRE_BROWSER"):
        pytest.fail("SCHEDLANG_REQUIRE_BROWSER is set but no Chromium is installed")
    pytest.skip("no Chromium here (CI installs Debian's chromium and sets SCHEDLANG_REQUIRE_BROWSER)")


_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_the_page_renders_in_a_headless_browser(tmp_path):
    browser = _browser()
    sch, model, check = _scheduled()
    page = tmp_path / "report.html"
    sch.report(str(page), model=model, verify=check)
    profile = tmp_path / "profile"
    shot = tmp_path / "report.png"
    common = [browser, *_FLAGS, f"--user-data-dir={profile}", "--window-size=1300,2000"]
    subprocess.run(common + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a page with content, not a blank one
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    for key, title in SECTIONS:  # every section made it into the rendered document
        assert f'id="{key}"' in dom and title in dom
    assert dom.count("<svg") == 2 and "SwiGLU_0" in dom
