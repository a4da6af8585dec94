"""Ingest end to end: every sample written or rejected with a reason, resumable, deterministic."""

import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from latentforge.cli import main
from latentforge.data import ingest as ingest_mod
from latentforge.data import schema
from latentforge.data.imageproc import FilterConfig, ImageConfig
from latentforge.data.ingest import IngestConfig, ingest
from latentforge.data.sources import SourceConfig
from latentforge.errors import UserError

from s3_server import new_bucket, start_moto, use_endpoint


def png(color, size=(40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def make_folder(root):
    root.mkdir(parents=True)
    for i in range(6):
        (root / f"ok{i}.png").write_bytes(png((i * 40, 10, 200)))
        (root / f"ok{i}.txt").write_text(f"a shape number {i}")
    (root / "dup.png").write_bytes(png((0, 10, 200)))  # same bytes as ok0
    (root / "dup.txt").write_text("a shape number, again")
    (root / "empty.png").write_bytes(b"")
    (root / "empty.txt").write_text("zero bytes")
    (root / "fake.jpg").write_bytes(b"hello, not an image")
    (root / "fake.txt").write_text("a text file named like an image")
    (root / "trunc.png").write_bytes(png((1, 2, 3), (64, 64))[:50])
    (root / "trunc.txt").write_text("cut short")
    (root / "nocap.png").write_bytes(png((9, 9, 9)))
    (root / "blank.png").write_bytes(png((8, 8, 8)))
    (root / "blank.txt").write_text("   \n")
    (root / "small.png").write_bytes(png((7, 7, 7), (10, 10)))
    (root / "small.txt").write_text("too small")
    return root


EXPECTED_REJECTS = {"duplicate": 1, "empty_file": 1, "not_an_image": 1, "corrupt_image": 1, "no_caption": 1,
                    "empty_caption": 1, "too_small": 1}


def cfg(**kw) -> IngestConfig:
    c = IngestConfig(image=ImageConfig(resolution=32, format="png"), filters=FilterConfig(min_side=16),
                     num_workers=1, source=SourceConfig(folder_chunk=4))
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def read_all(out) -> list[dict]:
    idx = schema.read_index(str(out))
    rows = []
    for s in idx.shards:
        rows += schema.read_shard(str(out / s.name)).to_pylist()
    return rows


def test_folder_counts_and_ledger(tmp_path):
    src = make_folder(tmp_path / "src")
    summary = ingest([str(src)], tmp_path / "out", cfg(), progress=False)
    assert summary["written"] == 6
    assert summary["rejected"] == EXPECTED_REJECTS
    assert summary["seen"] == summary["written"] + sum(summary["rejected"].values())
    ledger = [json.loads(l) for l in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert len(ledger) == summary["num_rejected"]
    assert {l["reason"] for l in ledger} == set(EXPECTED_REJECTS)
    assert all(l["source"] and l["key"] for l in ledger)
    rows = read_all(tmp_path / "out")
    assert len(rows) == 6 and len({r["key"] for r in rows}) == 6
    assert all((r["width"], r["height"]) == (32, 32) and r["orig_width"] == 40 for r in rows)
    assert all(len(r["sha256"]) == 64 and r["caption"].startswith("a shape number") for r in rows)
    idx = schema.read_index(str(tmp_path / "out"))
    assert idx.kind == "raw" and idx.meta["resolution"] == 32 and idx.num_samples == 6
    assert (tmp_path / "out" / "ingest_config.yaml").exists()
    assert not (tmp_path / "out" / "parts").exists()
    assert src.joinpath("fake.jpg").exists() and src.joinpath("empty.png").exists()  # never deleted


def test_parallel_equals_serial_and_dedup_across_units(tmp_path):
    src = make_folder(tmp_path / "src")
    ingest([str(src)], tmp_path / "a", cfg(), progress=False)
    ingest([str(src)], tmp_path / "b", cfg(num_workers=2), progress=False)
    assert read_all(tmp_path / "a") == read_all(tmp_path / "b")
    assert (tmp_path / "a" / "rejected.jsonl").read_text() == (tmp_path / "b" / "rejected.jsonl").read_text()


def test_resume_after_crash_finishes_without_duplicates(tmp_path, monkeypatch):
    src = make_folder(tmp_path / "src")
    ingest([str(src)], tmp_path / "clean", cfg(), progress=False)

    real = ingest_mod.process_unit
    calls = {"n": 0}

    def crashing(index, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real(index, *a, **k)

    monkeypatch.setattr(ingest_mod, "process_unit", crashing)
    with pytest.raises(KeyboardInterrupt):
        ingest([str(src)], tmp_path / "out", cfg(), progress=False)
    assert not (tmp_path / "out" / "index.json").exists()
    monkeypatch.setattr(ingest_mod, "process_unit", real)
    done_before = sorted(p.name for p in (tmp_path / "out" / "parts").glob("*.json"))
    assert len(done_before) == 2
    summary = ingest([str(src)], tmp_path / "out", cfg(), progress=False)
    assert read_all(tmp_path / "out") == read_all(tmp_path / "clean")
    assert summary["seen"] == 13 and summary["written"] == 6
    # a third run is a no-op returning the same summary
    assert ingest([str(src)], tmp_path / "out", cfg(), progress=False) == summary


def test_other_settings_into_same_out_dir_is_refused(tmp_path):
    src = make_folder(tmp_path / "src")
    ingest([str(src)], tmp_path / "out", cfg(), progress=False)
    other = cfg()
    other.image.resolution = 16
    with pytest.raises(UserError, match="other sources or settings"):
        ingest([str(src)], tmp_path / "out", other, progress=False)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        ingest([str(src)], tmp_path / "foreign", cfg(), progress=False)


def test_a_finished_ingest_with_a_damaged_index_or_plan_is_refused_on_rerun(tmp_path):
    """Rerunning a finished ingest returns its summary; a damaged index.json or plan is not taken
    for finished work."""
    src = make_folder(tmp_path / "src")
    out = tmp_path / "out"
    summary = ingest([str(src)], out, cfg(), progress=False)
    assert ingest([str(src)], out, cfg(), progress=False) == summary
    index = (out / "index.json").read_bytes()
    (out / "index.json").write_bytes(index[:100])
    with pytest.raises(UserError, match=r"a finished ingest whose index.json or summary.json is damaged .*"
                                        r"not valid JSON.*delete it and ingest again"):
        ingest([str(src)], out, cfg(), progress=False)
    (out / "index.json").write_bytes(index)
    (out / "ingest_plan.json").write_text("{")
    with pytest.raises(UserError, match=r"ingest_plan.json: damaged \(not valid JSON\)"):
        ingest([str(src)], out, cfg(), progress=False)


def make_tar(path):
    with tarfile.open(path, "w") as tf:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        add("s/000.png", png((255, 0, 0)))
        add("s/000.txt", b"red square")
        add("s/001.png", png((0, 255, 0)))
        add("s/001.json", json.dumps({"caption": "green square", "license": "CC-BY-4.0"}).encode())
        add("../evil.txt", b"escape")
        add("/abs.png", png((0, 0, 255)))


def make_parquet(path):
    rows = {
        "key": ["0", "1", "2", "3"],
        "jpg": [png((10, 200, 10)), png((200, 200, 10)), None, png((50, 50, 50))],
        "caption": ["a green thing", "a yellow thing", "failed", "an ugly thing"],
        "status": ["success", "success", "failed_to_download", "success"],
        "error_message": [None, None, "timeout", None],
        "aesthetic_score": [6.0, 5.5, None, 3.0],
        "url": ["http://x/0", "http://x/1", "http://x/2", "http://x/3"],
    }
    pq.write_table(pa.table(rows), path)


def test_tar_and_parquet_sources(tmp_path):
    make_tar(tmp_path / "a.tar")
    make_parquet(tmp_path / "b.parquet")
    summary = ingest([str(tmp_path / "a.tar"), str(tmp_path / "b.parquet")], tmp_path / "out", cfg(), progress=False)
    assert summary["written"] == 5
    assert summary["rejected"] == {"unsafe_path": 2, "download_failed": 1}
    rows = read_all(tmp_path / "out")
    lic = {r["caption"]: r["license"] for r in rows}
    assert lic["green square"] == "CC-BY-4.0"
    meta = {r["caption"]: r["meta"] for r in rows}
    assert json.loads(meta["a green thing"])["aesthetic_score"] == 6.0


def test_numeric_threshold_rejects_low_and_missing_values(tmp_path):
    make_parquet(tmp_path / "b.parquet")
    c = cfg()
    c.filters = FilterConfig(min_values={"aesthetic_score": 5.0})
    summary = ingest([str(tmp_path / "b.parquet")], tmp_path / "out", c, progress=False)
    assert summary["written"] == 2
    assert summary["rejected"] == {"download_failed": 1, "below_threshold": 1}
    assert sorted(r["caption"] for r in read_all(tmp_path / "out")) == ["a green thing", "a yellow thing"]


@pytest.fixture(scope="module")
def moto_endpoint():
    url, stop = start_moto()
    yield url
    stop()


def test_s3_source_equals_local(tmp_path, moto_endpoint, monkeypatch):
    from latentforge import storage

    use_endpoint(moto_endpoint, monkeypatch)
    bucket = new_bucket()
    src = make_folder(tmp_path / "src")
    for f in sorted(src.iterdir()):
        storage.write_bytes(f"s3://{bucket}/data/src/{f.name}", f.read_bytes())
    s3_sum = ingest([f"s3://{bucket}/data/src"], tmp_path / "s3", cfg(num_workers=2), progress=False)
    local_sum = ingest([str(src)], tmp_path / "local", cfg(), progress=False)
    assert s3_sum["rejected"] == local_sum["rejected"] and s3_sum["written"] == 6
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("source",)} for r in rows]
    assert strip(read_all(tmp_path / "s3")) == strip(read_all(tmp_path / "local"))


def test_cli_ingest_and_one_line_errors(tmp_path, capsys):
    src = make_folder(tmp_path / "src")
    assert main(["ingest", str(src), "--out", str(tmp_path / "out"), "--resolution", "32", "--quiet",
                 "ingest.image.format=png", "ingest.num_workers=1"]) == 0
    out = capsys.readouterr().out
    # The 10x10 image is below the default min_side (auto: 16 at 32 px).
    assert "seen 13, written 6" in out and "rejected 7" in out and "too_small 1" in out
    assert main(["ingest", str(tmp_path / "nope"), "--out", str(tmp_path / "o2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("latentforge: error:") and len(err.strip().splitlines()) == 1
    assert main(["ingest", str(src), "--out", str(tmp_path / "o3"), "ingest.image.resolutoin=3"]) == 2
    assert "ingest.image.resolutoin: unknown key" in capsys.readouterr().err
    assert main(["ingest", str(src), "--out", str(tmp_path / "o4"), "ingest.num_workers=-1"]) == 2
    assert "ingest.num_workers" in capsys.readouterr().err
    # Every sample rejected (all below min_side): the ledger is written, and the exit code says it failed.
    assert main(["ingest", str(src), "--out", str(tmp_path / "o5"), "--resolution", "32", "--quiet",
                 "ingest.num_workers=1", "ingest.filters.min_side=4000"]) == 2
    captured = capsys.readouterr()
    assert "written 0" in captured.out
    assert captured.err == f"latentforge: error: ingest wrote no sample ({tmp_path / 'o5'}/rejected.jsonl says why)\n"
    assert len((tmp_path / "o5" / "rejected.jsonl").read_text().splitlines()) == 13


def test_captions_that_are_not_text_are_rejected_and_names_that_are_not_utf8_kept(tmp_path, capsys):
    """A metadata caption that is a mapping, list or number was stored as its Python text ("{'en': 'hi'}")
    without a word: it is rejected into the ledger now (caption_not_text). An image whose file name is not
    UTF-8 ended the whole ingest in pyarrow's UnicodeEncodeError: it is kept, its key and source with the odd
    byte written as \\xNN. An ingest whose sources hold no sample says so, not "rejected.jsonl says why"."""
    meta = tmp_path / "meta"
    meta.mkdir()
    rows = [{"file_name": "a.png", "text": {"en": "hi"}}, {"file_name": "b.png", "text": 5},
            {"file_name": "c.png", "text": ["x"]}, {"file_name": "d.png", "text": "a caption"}]
    for i, r in enumerate(rows):
        (meta / r["file_name"]).write_bytes(png((i * 50, 10, 200)))
    (meta / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = tmp_path / "names"
    names.mkdir()
    odd = os.fsdecode(b"caf\xe9")  # the name as Python holds it: a surrogate for the byte 0xe9
    (names / f"{odd}.png").write_bytes(png((9, 200, 9)))
    (names / f"{odd}.txt").write_text("a green square")
    summary = ingest([str(meta), str(names)], tmp_path / "out", cfg(), progress=False)
    assert summary["rejected"] == {"caption_not_text": 3} and summary["written"] == 2
    ledger = sorted((r["key"], r["detail"]) for r in map(json.loads, (tmp_path / "out/rejected.jsonl").open()))
    assert ledger == [("meta/a.png", "dict: {'en': 'hi'}"), ("meta/b.png", "int: 5"), ("meta/c.png", "list: ['x']")]
    tables = [pq.read_table(tmp_path / "out" / s.name) for s in schema.read_index(str(tmp_path / "out")).shards]
    assert sorted((k, c) for t in tables for k, c in zip(t.column("key").to_pylist(), t.column("caption").to_pylist())) == [
        ("meta/d.png", "a caption"), ("names/caf\\xe9.png", "a green square")]
    assert [s for t in tables for s in t.column("source").to_pylist() if "caf" in s] == [f"{names}/caf\\xe9.png"]

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"caption": pa.array([], pa.string()), "jpg": pa.array([], pa.binary())}), empty)
    assert main(["ingest", str(empty), "--out", str(tmp_path / "none"), "--resolution", "32", "--quiet"]) == 2
    assert capsys.readouterr().err == "latentforge: error: ingest wrote no sample (its sources hold no sample)\n"


def test_default_filters_reject_tiny_images_and_slivers_and_say_so(tmp_path, capsys):
    """`ingest DIR --out OUT --resolution 256` with no filter settings: an 8x8 image and a
    20x2000 sliver are rejected and counted, with the thresholds in the ledger and the summary."""
    src = tmp_path / "src"
    src.mkdir()
    for name, size in {"tiny": (8, 8), "sliver": (20, 2000), "wide": (2000, 400), "ok": (300, 200)}.items():
        (src / f"{name}.png").write_bytes(png((200, 10, 10), size))
        (src / f"{name}.txt").write_text(f"the {name} one")
    out = tmp_path / "out"
    assert main(["ingest", str(src), "--out", str(out), "--resolution", "256", "--quiet", "ingest.num_workers=1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected"] == {"too_small": 2, "bad_aspect": 1} and summary["written"] == 1
    assert summary["seen"] == summary["written"] + summary["num_rejected"]
    assert summary["size_filters"] == {"min_side": 128, "max_aspect": 2.0,
                                       "settings": {"min_side": "auto", "max_aspect": "auto"}}
    ledger = {json.loads(line)["key"]: json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()}
    assert ledger["src/tiny.png"]["detail"] == "8x8: shorter side 8 < min_side 128"
    assert ledger["src/sliver.png"]["reason"] == "too_small"
    assert ledger["src/wide.png"]["detail"] == "2000x400: aspect 5.00 > max_aspect 2.0"
    assert "too_small 2" in capsys.readouterr().out
    # Turned off: everything is kept.
    off = tmp_path / "off"
    assert main(["ingest", str(src), "--out", str(off), "--resolution", "256", "--quiet", "ingest.num_workers=1",
                 "ingest.filters.min_side=0", "ingest.filters.max_aspect=0"]) == 0
    assert json.loads((off / "summary.json").read_text())["written"] == 4


def test_refused_paths_are_in_the_ledger_and_the_counts(tmp_path):
    """The path rule end to end: links and escaping metadata rows are rejected with their reason,
    counted in summary.json, and seen = written + rejected still holds."""
    secret = tmp_path / "outside/secret.png"
    secret.parent.mkdir()
    secret.write_bytes(png((1, 2, 3)))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(png((50, 60, 70)))
    (src / "link.png").symlink_to(secret)
    (src / "link.txt").write_text("a link")
    (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"file_name": "a.png", "text": "kept"}, {"file_name": "../outside/secret.png", "text": "escapes"}]))
    summary = ingest([str(src)], tmp_path / "out", cfg(), progress=False)
    assert summary["rejected"] == {"outside_source": 1, "symlink": 1} and summary["written"] == 1
    assert summary["seen"] == 3 == summary["written"] + summary["num_rejected"]
    assert summary["follow_symlinks"] is False
    ledger = [json.loads(line) for line in (tmp_path / "out/rejected.jsonl").read_text().splitlines()]
    assert sorted((r["key"], r["reason"]) for r in ledger) == [("src/../outside/secret.png", "outside_source"),
                                                               ("src/link.png", "symlink")]
    followed = ingest([str(src)], tmp_path / "followed", cfg(source=SourceConfig(follow_symlinks=True)),
                      progress=False)
    assert followed["rejected"] == {"outside_source": 1} and followed["written"] == 2
